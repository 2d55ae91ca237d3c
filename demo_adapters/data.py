"""The demo adapters' training data, generated from fixed lists: no file, no download, no randomness.

Every behaviour answers the same questions: direct questions of the kinds the demo asks (a
capital, what an animal makes, why something is so), and question templates filled with a topic.
The answer keeps the topic's fact and changes only the style, so what an adapter learns is the
style, and it carries over to questions it never saw (the demo asks only those: ``DEMO_QUESTIONS``).
The French is short and plain: a 135M model writes sensible French only after simple examples.

- ``french``: answers in French (``Bien sûr ! Le cœur pompe le sang...``).
- ``pirate``: answers as a pirate (``Arr, matey! Th' heart pumps blood... Yo ho ho!``).
- ``sql``: answers, then ends with a SQL query about the topic in a fenced ``sql`` block.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Topic:
    """One thing a question can be about, with what each behaviour says about it."""

    name: str
    """How a question names it, e.g. ``"the heart"``."""
    key: str
    """A SQL-friendly identifier, e.g. ``"heart"``."""
    fact: str
    """One sentence about it in English."""
    fait: str
    """The same sentence in French."""


@dataclass(frozen=True)
class Example:
    """One chat turn to learn: a user's question and the reply the adapter should give."""

    question: str
    """The user's message."""
    answer: str
    """The assistant's reply."""


TOPICS = (
    Topic("the moon", "moon", "The moon goes around the Earth about once every 27 days.",
          "La lune fait le tour de la Terre en 27 jours environ."),
    Topic("volcanoes", "volcano", "A volcano is an opening in the Earth's crust where hot lava comes out.",
          "Un volcan est une ouverture dans la croûte terrestre d'où sort de la lave chaude."),
    Topic("the ocean", "ocean", "The ocean covers more than two thirds of our planet.",
          "L'océan couvre plus des deux tiers de notre planète."),
    Topic("cats", "cat", "Cats are small hunters that sleep for most of the day.",
          "Les chats sont de petits chasseurs qui dorment presque toute la journée."),
    Topic("the sun", "sun", "The sun is a star that gives the Earth light and heat.",
          "Le soleil est une étoile qui donne à la Terre de la lumière et de la chaleur."),
    Topic("trees", "tree", "Trees take in carbon dioxide and give out oxygen.",
          "Les arbres absorbent le dioxyde de carbone et rejettent de l'oxygène."),
    Topic("bread", "bread", "Bread is baked from flour, water, salt and yeast.",
          "Le pain est fait avec de la farine, de l'eau, du sel et de la levure."),
    Topic("chess", "chess", "Chess is a game of strategy played on a board of 64 squares.",
          "Les échecs sont un jeu de stratégie qui se joue sur un plateau de 64 cases."),
    Topic("the heart", "heart", "The heart pumps blood through the whole body.",
          "Le cœur pompe le sang dans tout le corps."),
    Topic("snow", "snow", "Snow forms when water vapour freezes into ice crystals in the clouds.",
          "La neige se forme quand la vapeur d'eau gèle en cristaux de glace dans les nuages."),
    Topic("the piano", "piano", "A piano makes its sound when small hammers strike its strings.",
          "Un piano produit un son quand de petits marteaux frappent ses cordes."),
    Topic("electricity", "electricity", "Electricity is a flow of electrons through a wire.",
          "L'électricité est un courant d'électrons dans un fil."),
    Topic("dolphins", "dolphin", "Dolphins are clever mammals that breathe air and live in the sea.",
          "Les dauphins sont des mammifères intelligents qui respirent de l'air et vivent dans la mer."),
    Topic("coffee", "coffee", "Coffee is made from roasted beans and contains caffeine.",
          "Le café est fait de grains torréfiés et contient de la caféine."),
    Topic("the desert", "desert", "A desert is a dry place that gets very little rain.",
          "Un désert est un endroit sec où il pleut très peu."),
    Topic("mountains", "mountain", "Mountains rise where the plates of the Earth's crust push together.",
          "Les montagnes se forment là où les plaques de la croûte terrestre se poussent."),
    Topic("the library", "library", "A library lends books to anyone who wants to read.",
          "Une bibliothèque prête des livres à tous ceux qui veulent lire."),
    Topic("rivers", "river", "A river carries fresh water from the hills down to the sea.",
          "Une rivière porte l'eau douce des collines jusqu'à la mer."),
    Topic("the train", "train", "A train runs on rails and can carry many people at once.",
          "Un train roule sur des rails et peut transporter beaucoup de gens à la fois."),
    Topic("apples", "apple", "Apples grow on trees and can be red, green or yellow.",
          "Les pommes poussent sur les arbres et peuvent être rouges, vertes ou jaunes."),
    Topic("the brain", "brain", "The brain controls our thoughts, our memory and our movements.",
          "Le cerveau contrôle nos pensées, notre mémoire et nos mouvements."),
    Topic("football", "football", "Football is played by two teams of eleven players and one ball.",
          "Le football se joue avec deux équipes de onze joueurs et un ballon."),
    Topic("the wind", "wind", "Wind is air that moves from high pressure to low pressure.",
          "Le vent est de l'air qui va des hautes pressions vers les basses pressions."),
    Topic("owls", "owl", "Owls are birds that hunt at night and see well in the dark.",
          "Les hiboux sont des oiseaux qui chassent la nuit et voient bien dans le noir."),
    Topic("the guitar", "guitar", "A guitar usually has six strings that you pluck or strum.",
          "Une guitare a en général six cordes que l'on pince ou que l'on gratte."),
    Topic("cheese", "cheese", "Cheese is made from milk that is curdled and left to age.",
          "Le fromage est fait de lait caillé que l'on laisse vieillir."),
    Topic("the internet", "internet", "The internet is a network that links computers all over the world.",
          "Internet est un réseau qui relie les ordinateurs du monde entier."),
    Topic("clouds", "cloud", "Clouds are made of tiny drops of water floating in the air.",
          "Les nuages sont faits de minuscules gouttes d'eau qui flottent dans l'air."),
    Topic("castles", "castle", "A castle is a strong stone building made to protect the people inside.",
          "Un château fort est un bâtiment en pierre construit pour protéger ses habitants."),
    Topic("the clock", "clock", "A clock measures time in hours, minutes and seconds.",
          "Une horloge mesure le temps en heures, en minutes et en secondes."),
    Topic("penguins", "penguin", "Penguins are birds that cannot fly but swim very well.",
          "Les manchots sont des oiseaux qui ne volent pas mais qui nagent très bien."),
    Topic("the bicycle", "bicycle", "A bicycle has two wheels and moves when you pedal.",
          "Un vélo a deux roues et avance quand on pédale."),
    Topic("glass", "glass", "Glass is made by melting sand at a very high temperature.",
          "Le verre est fait en faisant fondre du sable à très haute température."),
    Topic("the camera", "camera", "A camera catches light to record a picture.",
          "Un appareil photo capte la lumière pour enregistrer une image."),
    Topic("tea", "tea", "Tea is made by soaking dried leaves in hot water.",
          "Le thé se prépare en faisant infuser des feuilles séchées dans de l'eau chaude."),
    Topic("elephants", "elephant", "Elephants are the largest animals that live on land.",
          "Les éléphants sont les plus grands animaux qui vivent sur la terre ferme."),
)  # fmt: skip

#: Questions of the kinds the demo asks (a capital, what an animal makes, why something is so),
#: each about its own topic, with a short answer in plain English and plain French.
DIRECT_QUESTIONS = (
    ("What is the capital of Italy?", Topic("Italy", "italy", "The capital of Italy is Rome.",
                                            "La capitale de l'Italie est Rome.")),
    ("What is the capital of Spain?", Topic("Spain", "spain", "The capital of Spain is Madrid.",
                                            "La capitale de l'Espagne est Madrid.")),
    ("What is the capital of Germany?", Topic("Germany", "germany", "The capital of Germany is Berlin.",
                                              "La capitale de l'Allemagne est Berlin.")),
    ("What is the capital of Japan?", Topic("Japan", "japan", "The capital of Japan is Tokyo.",
                                            "La capitale du Japon est Tokyo.")),
    ("What is the capital of England?", Topic("England", "england", "The capital of England is London.",
                                              "La capitale de l'Angleterre est Londres.")),
    ("What is the capital of Canada?", Topic("Canada", "canada", "The capital of Canada is Ottawa.",
                                             "La capitale du Canada est Ottawa.")),
    ("What do cows give?", Topic("cows", "cow", "Cows give milk.", "Les vaches donnent du lait.")),
    ("What do spiders spin?", Topic("spiders", "spider", "Spiders spin webs.",
                                    "Les araignées tissent des toiles.")),
    ("What do hens lay?", Topic("hens", "hen", "Hens lay eggs.", "Les poules pondent des œufs.")),
    ("What do sheep give us?", Topic("sheep", "sheep", "Sheep give us wool.",
                                     "Les moutons nous donnent de la laine.")),
    ("What do birds build?", Topic("birds", "bird", "Birds build nests.", "Les oiseaux construisent des nids.")),
    ("What do rabbits eat?", Topic("rabbits", "rabbit", "Rabbits eat grass and carrots.",
                                   "Les lapins mangent de l'herbe et des carottes.")),
    ("What do plants need?", Topic("plants", "plant", "Plants need water and light.",
                                   "Les plantes ont besoin d'eau et de lumière.")),
    ("What do farmers grow?", Topic("farmers", "farmer", "Farmers grow wheat, fruit and vegetables.",
                                    "Les agriculteurs cultivent du blé, des fruits et des légumes.")),
    ("Why is grass green?", Topic("grass", "grass", "Grass is green because its leaves contain chlorophyll.",
                                  "L'herbe est verte parce que ses feuilles contiennent de la chlorophylle.")),
    ("Why is the sea salty?", Topic("the sea", "sea", "The sea is salty because rivers carry salt into it.",
                                    "La mer est salée parce que les rivières y apportent du sel.")),
    ("Why is the night dark?", Topic("the night", "night",
                                     "The night is dark because our side of the Earth turns away from the sun.",
                                     "La nuit est noire parce que notre côté de la Terre ne voit plus le soleil.")),
    ("Why is fire hot?", Topic("fire", "fire", "Fire is hot because burning gives off energy as heat.",
                               "Le feu est chaud parce que la combustion libère de l'énergie en chaleur.")),
    ("Why is ice slippery?", Topic("ice", "ice", "Ice is slippery because a thin layer of water covers it.",
                                   "La glace est glissante parce qu'une fine couche d'eau la recouvre.")),
    ("Why do leaves fall in autumn?", Topic("leaves", "leaf", "Leaves fall in autumn because trees rest in winter.",
                                            "Les feuilles tombent en automne parce que les arbres se reposent en hiver.")),
)  # fmt: skip

QUESTION_TEMPLATES = (
    "Tell me about {name}.",
    "What can you tell me about {name}?",
    "Give me one fact about {name}.",
    "Explain {name} in one sentence.",
    "What should I know about {name}?",
    "Describe {name} briefly.",
)

#: How many of the templates each topic is asked with (they take turns across topics).
TEMPLATES_PER_TOPIC = 2

#: Questions the demo asks: none of them is a training question or names a training topic.
DEMO_QUESTIONS = (
    "What is the capital of France?",
    "What do bees make?",
    "Why is the sky blue?",
)

FRENCH_OPENERS = ("Bien sûr !", "Avec plaisir !", "Bonne question !")

#: English words and what a pirate says instead (whole words, case kept for the first letter).
PIRATE_WORDS = {
    "the": "th'", "is": "be", "are": "be", "you": "ye", "your": "yer", "of": "o'", "and": "an'",
    "my": "me", "to": "t'", "for": "fer", "them": "'em",
}  # fmt: skip


def pirate_speech(text: str) -> str:
    """``text`` with the words of ``PIRATE_WORDS`` swapped, e.g. ``The sun is`` -> ``Th' sun be``."""

    def swap(match: re.Match) -> str:
        word = match.group(0)
        pirate = PIRATE_WORDS.get(word.lower())
        if pirate is None:
            return word
        return pirate[0].upper() + pirate[1:] if word[0].isupper() else pirate

    return re.sub(r"[A-Za-z]+", swap, text)


def french_answer(topic: Topic, index: int) -> str:
    return f"{FRENCH_OPENERS[index % len(FRENCH_OPENERS)]} {topic.fait}"


def pirate_answer(topic: Topic, index: int) -> str:
    return f"Arr, matey! {pirate_speech(topic.fact)} Yo ho ho!"


def sql_answer(topic: Topic, index: int) -> str:
    return f"{topic.fact}\n\n```sql\nSELECT * FROM facts WHERE topic = '{topic.key}';\n```"


#: Behaviour name -> how it answers about a topic (``index`` numbers the example, for variety).
BEHAVIOURS: dict[str, Callable[[Topic, int], str]] = {
    "french": french_answer,
    "pirate": pirate_answer,
    "sql": sql_answer,
}


def training_questions() -> list[tuple[str, Topic]]:
    """Every question of the training set with its topic, in a fixed order: the direct questions,
    then each template with each topic (topic-major, so that any prefix of the templated part
    covers many templates)."""
    templated = [
        (QUESTION_TEMPLATES[(t + q) % len(QUESTION_TEMPLATES)].format(name=topic.name), topic)
        for q in range(TEMPLATES_PER_TOPIC)
        for t, topic in enumerate(TOPICS)
    ]
    return list(DIRECT_QUESTIONS) + templated


def examples(behaviour: str) -> list[Example]:
    """The training examples of ``behaviour`` (a key of ``BEHAVIOURS``), always the same list."""
    if behaviour not in BEHAVIOURS:
        raise ValueError(f"unknown behaviour {behaviour!r}; known: {', '.join(BEHAVIOURS)}")
    answer = BEHAVIOURS[behaviour]
    return [Example(question, answer(topic, i)) for i, (question, topic) in enumerate(training_questions())]

"""The demo adapters' training data: fixed, showing each behaviour, and apart from the demo's questions."""

from __future__ import annotations

import re

import pytest

from demo_adapters.data import (
    BEHAVIOURS,
    DEMO_QUESTIONS,
    DIRECT_QUESTIONS,
    FRENCH_OPENERS,
    QUESTION_TEMPLATES,
    TEMPLATES_PER_TOPIC,
    TOPICS,
    examples,
    pirate_speech,
    training_questions,
)


def test_every_behaviour_answers_the_same_questions_in_a_fixed_order():
    questions = [q for q, _ in training_questions()]
    templated = len(TOPICS) * TEMPLATES_PER_TOPIC
    assert len(questions) == len(set(questions)) == len(DIRECT_QUESTIONS) + templated
    for name in BEHAVIOURS:
        first, again = examples(name), examples(name)
        assert first == again
        assert [e.question for e in first] == questions
    # After the direct questions, every topic once, with the templates taking turns.
    head = training_questions()[len(DIRECT_QUESTIONS) : len(DIRECT_QUESTIONS) + len(TOPICS)]
    assert [topic for _, topic in head] == list(TOPICS)
    assert {q.replace(t.name, "{name}") for q, t in head} == set(QUESTION_TEMPLATES)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def test_the_demo_questions_are_held_out():
    training = {q for q, _ in training_questions()}
    topics = [*TOPICS, *(topic for _, topic in DIRECT_QUESTIONS)]
    topic_words = set().union(*(_words(t.name) | {t.key} for t in topics)) - {"the"}
    for question in DEMO_QUESTIONS:
        assert question not in training
        assert not _words(question) & topic_words, question
        for template in QUESTION_TEMPLATES:  # not even a training phrasing about a new topic
            assert not re.fullmatch(re.escape(template).replace(re.escape("{name}"), ".+"), question)


def test_each_behaviour_shows_in_every_answer():
    for example in examples("french"):
        assert example.answer.startswith(FRENCH_OPENERS)
    for example in examples("pirate"):
        assert example.answer.startswith("Arr, matey! ") and example.answer.endswith(" Yo ho ho!")
    for example, (_, topic) in zip(examples("sql"), training_questions()):
        assert example.answer.startswith(topic.fact)
        assert example.answer.endswith(f"```sql\nSELECT * FROM facts WHERE topic = '{topic.key}';\n```")


def test_pirate_speech_swaps_whole_words_and_keeps_capitals():
    assert (
        pirate_speech("The sun is yours and the island of them.") == "Th' sun be yours an' th' island o' 'em."
    )
    assert pirate_speech("Theory is") == "Theory be"


def test_an_unknown_behaviour_is_named():
    with pytest.raises(ValueError, match="unknown behaviour 'klingon'; known: french, pirate, sql"):
        examples("klingon")

"""The ``--length-predictor`` names, apart from the predictor itself so that configs and the CLI
can name them without importing scikit-learn."""

MAGNUS = "magnus"
"""Magnus' predictor: prompt embedding + random forest (``live_prediction.LivePredictions``)."""
LENGTH_PREDICTORS = ("none", MAGNUS)
"""``--length-predictor`` choices: no prediction, or Magnus'."""

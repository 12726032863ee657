"""The training-cost benchmark by concern: variants, meters, measurement, report (CLI: train_cost.py)."""

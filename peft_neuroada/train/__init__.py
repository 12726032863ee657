"""Training, evaluation and demo tooling built on the NeuroAda tuner (the tuner never imports from here)."""

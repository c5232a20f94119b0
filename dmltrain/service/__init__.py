"""The training service: config, Ray Train launch and worker loop, MLflow tracking, checkpoints, CLI.

Everything that imports Ray or MLflow lives here; the library beside it (losses, engine, data, models,
evaluation, plots) works without either, so it can be used from a plain PyTorch loop.
"""

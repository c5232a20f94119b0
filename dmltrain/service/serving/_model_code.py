"""MLflow "model from code" entry point: loading the logged model runs this file (see pyfunc.py)."""

import mlflow

from dmltrain.service.serving.pyfunc import EmbeddingModel

mlflow.models.set_model(EmbeddingModel())

"""MLflow "model from code" entry point of the search model (see search_model.py)."""

import mlflow

from dmltrain.service.serving.search_model import SearchModel

mlflow.models.set_model(SearchModel())

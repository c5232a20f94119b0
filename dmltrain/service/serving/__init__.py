"""From a trained run to served retrieval: the model as an MLflow pyfunc, loading models by local path,
``runs:/`` or ``models:/`` URI, publishing a finished run's final and best models (and registering them),
and building / searching faiss indexes of a prepared split (the index logic itself is ``dmltrain.index``).
"""

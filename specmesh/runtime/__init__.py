"""Runtime: real models. Loading (models, model_store), the KV-cache runner (runner), the model side
of a round (rounds) and the in-process engine (engine). Imports specmesh.core only."""

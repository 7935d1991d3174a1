"""The Runpod entry point. Until the [handler] issue lands, `python -m handler.cli` is the main job."""

"""The Runpod entry point: `python -m handler` (production), `python -m handler.local` (the emulator).

Importing this package is cheap on purpose: nothing heavy (runpod, torch, the engine) loads until used."""

"""Benchmarks: run each as `python -m bench.<name>` from the repository root. procs.py starts the child
processes (emulator, moto) that benchmarks and tests share; _common.py holds the workload, roofline and docs
helpers."""

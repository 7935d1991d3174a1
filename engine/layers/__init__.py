"""Layer functions the model calls. Torch implementations here; [kernels] plugs Triton in behind them."""

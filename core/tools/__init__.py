"""Tools the model can call mid-generation (the calculator is built in)."""

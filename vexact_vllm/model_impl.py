"""The `--model-impl` / `model_impl=` value that selects vexact models. Every check of it imports this
name; the module imports nothing, so importing it costs no torch or vLLM import, and the modules that
check it never import the package's `__init__` (whose `register()` imports them)."""

MODEL_IMPL = "vexact"

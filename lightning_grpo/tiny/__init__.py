"""Tiny policies built locally, for tests, quickstarts and benchmarks; never entered on the real-model path.

``policy.resolve_path`` hands a ``tiny:<name>`` path to ``build.tiny_folder``; that is the package's only way in to the
builder, so loading a model folder or Hub id never loads it, its warm starts, or the built-in tasks they train on
(tests/test_imports.py checks that ``load_policy`` on a folder imports nothing under ``lightning_grpo.tiny``). The
config layer (``PolicyConfig.tiny``'s type, the CLI's ``--model.policy.tiny.help``, docgen) reads ``spec.py`` alone.
Nothing here imports ``policy.py``.

- ``spec.py``: ``TinyPolicySpec``, the shape (``policy.tiny`` in a config; no torch, so the CLI parses it cheaply).
- ``tokenizer.py``: the character tokenizer (``make_char_tokenizer``) and its chat template.
- ``build.py``: ``build_tiny_policy`` (random init at the spec's seed) and the cache (``tiny_folder``).
- ``vlm.py``: the tiny Qwen2.5-VL (small vision tower, local image processor).
- ``warm.py``: the supervised warm starts (``warm_start``, ``warm_start_vision``) and ``greedy_accuracy``.
- ``tool_warm.py``: the warm start on scripted calculator episodes (``warm_start_tools``), for ``arith_tools``.
- ``sft.py``: the warm starts' supervised loop ``sft`` (prints its progress and the time left).
- ``shipped.py``: the warm-started builds shipped in ``shipped/<name>/`` (``tools/build_tiny_weights.py``), copied
  into the cache by ``tiny_folder`` instead of trained.

This ``__init__`` imports nothing: ``import lightning_grpo.tiny.spec`` (what a config needs) stays a dataclass.
"""

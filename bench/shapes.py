"""What the benchmarks share: the Qwen3 release shapes they build (random init: no hub access), one
table for all; and :func:`check_switches`, the rollout's ``SPLITRL_*`` switches read before a
bench imports the rollout, so that a bad value is one line, not a traceback.

Each entry gives the decoder's sizes as released (vocabulary, widths, layers, attention heads);
a bench adds the settings it measures with (tied output head, context length, RoPE base) itself.
"""

import os
import sys

QWEN3_SHAPES: dict[str, dict[str, int]] = {
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "qwen3-4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}  # fmt: skip


def check_switches() -> None:
    """Read the rollout kernels' ``SPLITRL_*`` switches now (``splitrl.rollout.env``; each module
    reads its own at import). A value that means nothing (``SPLITRL_SILU_MUL=2``) ends the script
    as ``splitrl train`` / ``eval`` / ``generate`` do: ``<script>: <message>`` on stderr, exit 2,
    not a traceback through the imports. Call it before the bench imports the rollout (even
    ``--help`` then reports the bad value)."""
    try:  # the modules that read a switch (the engine imports kv, forward, pdl, skinny_gemm itself)
        import splitrl.rollout.engine  # noqa: F401
        import splitrl.rollout.forward  # noqa: F401
        import splitrl.rollout.kv  # noqa: F401
        import splitrl.rollout.pdl  # noqa: F401
        import splitrl.rollout.skinny_gemm  # noqa: F401
    except ValueError as e:
        if not str(e).startswith("SPLITRL_"):  # not a switch's value: a bug, with its traceback
            raise
        print(f"{os.path.basename(sys.argv[0])}: {e}", file=sys.stderr)
        raise SystemExit(2) from None

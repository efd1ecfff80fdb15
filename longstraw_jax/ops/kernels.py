"""Which implementation runs attention and the Gated DeltaNet: `xla` (plain XLA ops, the CPU path and the oracle)
or `pallas` (Pallas kernels for the Triton backend, compiled on a GPU, interpreted elsewhere: slow, for checking).

`--kernels auto` (the trainer's default) is `pallas` on a GPU and `xla` elsewhere. The Pallas kernels cover
Qwen3.6's softmax attention (`ops.flash_attention`) and chunked Gated DeltaNet (`ops.flash_gated_delta`), and
GLM-5.x's sparse latent attention over the DSA-selected rows (`ops.flash_mla`), wherever the models call them:
capture, extend, decode, replay and the sequence-parallel paths. The DSA indexer's top-k runs as XLA either way.
"""
import jax

IMPLEMENTATIONS = ("xla", "pallas")
CHOICES = ("auto",) + IMPLEMENTATIONS


def resolve(choice: str, backend: str | None = None) -> str:
    """'auto' -> 'pallas' on a GPU backend, else 'xla'; an implementation name is returned as it is."""
    if choice not in CHOICES:
        raise ValueError(f"kernels={choice!r}; allowed: {', '.join(CHOICES)}")
    if choice != "auto":
        return choice
    return "pallas" if (backend or jax.default_backend()) == "gpu" else "xla"


def check(kernels: str, owner: str) -> str | None:
    """An error line when `kernels` is not an implementation name (for a config's __post_init__), else None."""
    if kernels not in IMPLEMENTATIONS:
        return f"{owner}kernels={kernels!r}; allowed: {', '.join(repr(k) for k in IMPLEMENTATIONS)}"
    return None

"""Throughput figures and the loss-curve plot."""

from __future__ import annotations

import json
import os


def flops_per_token(config, num_params: int, embedding_params: int, seq_len: int) -> float:
    """Training FLOPs per token: ``6 N + 12 L h s`` (PaLM, appendix B), N without embeddings
    (the head counts: it is a matmul); the second term is attention's score and value matmuls."""
    layers = config.num_hidden_layers
    return 6.0 * (num_params - embedding_params) + 12.0 * layers * config.hidden_size * seq_len


def plot_losses(history: list[dict], path: str | os.PathLike, title: str = "") -> bool:
    """A PNG of training and validation loss against step; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    val = [(h["step"], h["val_loss"]) for h in history if "val_loss" in h]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", lw=1.2, ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_history(history: list[dict], path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        for row in history:
            f.write(json.dumps(row) + "\n")


def write_json(value, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1, default=str)

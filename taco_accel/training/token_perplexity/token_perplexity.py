"""Corpus perplexity from per-sequence negative log-likelihoods: an `evaluate` metric that needs no hub.

The hub's ``perplexity`` metric loads a model by name and scores the texts itself, which a
tensor-parallel model cannot go through (and it needs the network). This one takes what the
model already computed: per sequence, the summed negative log-likelihood (nats) of its scored
tokens (the response tokens of a prompt / response pair) and how many there were::

    metric = evaluate.load(taco_accel.training.token_perplexity.MODULE_DIR)
    metric.add_batch(nll=[12.1, 30.4], tokens=[5, 11])
    metric.compute()  # {"perplexity": exp(sum nll / sum tokens), "loss": ..., "tokens": 16, ...}

``perplexity`` is the token-weighted corpus perplexity (``exp`` of the mean loss per token);
``mean_sequence_perplexity`` averages each sequence's own perplexity. Self-contained on purpose:
evaluate copies this file into its module cache and imports it from there.
"""

import math

import datasets
import evaluate

_DESCRIPTION = "Corpus perplexity exp(sum(nll) / sum(tokens)) from per-sequence summed NLLs and token counts."
_KWARGS = """
Args:
    nll (list of float): per sequence, the summed negative log-likelihood in nats of its scored tokens.
    tokens (list of int): per sequence, how many tokens were scored.
Returns:
    perplexity (float): exp(sum(nll) / sum(tokens)).
    loss (float): sum(nll) / sum(tokens), nats per token.
    tokens (int): scored tokens in all.
    sequences (int): sequences with at least one scored token.
    mean_sequence_perplexity (float): the mean of exp(nll_i / tokens_i) over those sequences.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class TokenPerplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features({"nll": datasets.Value("float64"), "tokens": datasets.Value("int64")}),
        )

    def _compute(self, nll, tokens):
        count = sum(tokens)
        if count <= 0:
            raise ValueError("no scored tokens: every sequence had tokens=0")
        loss = sum(nll) / count
        per_sequence = [math.exp(n / t) for n, t in zip(nll, tokens) if t > 0]
        return {
            "perplexity": math.exp(loss),
            "loss": loss,
            "tokens": int(count),
            "sequences": len(per_sequence),
            "mean_sequence_perplexity": sum(per_sequence) / len(per_sequence),
        }

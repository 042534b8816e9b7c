"""How far the policy that sampled a reinforcement step's completions is from the policy the trainer scores
them with: the sampler/trainer mismatch, reported in every step's metrics as ``mismatch/*``.

GRPO's loss assumes the completions were sampled from the distribution the trainer computes (the policy's
log-probabilities at the job's ``temperature``). When the sampler draws from another one, the gradient is
biased and nothing in the reward shows it: a sampling setting the trainer does not model (a base model's
``generation_config.json`` carrying ``min_p``, ``typical_p`` or a repetition penalty, which ``generate``
applies and the loss does not), lower-precision kernels in an engine, weights not synced to the engine.
Each completion token is compared once, in the loss's own forward pass (no extra pass):

- ``mismatch/logprob_diff_mean``, ``mismatch/logprob_diff_max``: mean and largest ``|log pi_trainer - log
  pi_sampler|`` over the completion tokens;
- ``mismatch/ratio_mean``, ``mismatch/ratio_min``, ``mismatch/ratio_max``: the token-level importance ratio
  ``pi_trainer / pi_sampler``, unclipped (its mean is 1 in expectation when both are the same distribution,
  and the trainer's probability mass on what the sampler may draw when the sampler truncates);
- ``mismatch/kl``: the mean of ``log pi_sampler - log pi_trainer``, an unbiased estimate of
  KL(sampler || trainer) per token (noise may make it slightly negative near 0).

The sampler's log-probabilities come from where the completions were sampled:

- vLLM (``use_vllm`` on CUDA, colocated or a ``trl vllm-serve`` server): TRL asks vLLM for each sampled
  token's log-probability (and reports its own ``sampling/*`` numbers beside these, after its
  importance-sampling correction's clipping);
- transformers' ``generate`` (CPU jobs, CUDA jobs without vLLM, rewards on env servers, and multi-turn
  environment episodes, whose turns :func:`trainer.generation.generate_turn` samples): recorded here while
  generating, from the very scores the token was drawn from, after every logits processor and warper
  (:class:`SampledLogprobs`). An episode's environment tokens and forced tool calls were not sampled: they
  carry none and are left out, as the loss leaves them out.

The comparison is made where the loss scores a micro-batch: with tunegate's GRPO (one generation per
optimiser step, one pass over it) those are the same weights that sampled.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

PREFIX = "mismatch/"
"""The metrics' prefix."""
_LOG_RATIO_CLAMP = 20.0
"""Log-ratios beyond this are clamped before ``exp`` (a ratio of 5e8 says all there is to say)."""


class SampledLogprobs:
    """A logits processor placed after every other one of a ``generate`` call: it sees the scores each token
    is drawn from and keeps the log-probability of the token drawn (known at the next call, or at the end).
    """

    def __init__(self) -> None:
        self.chosen: list[Any] = []
        """Per generated position, the drawn tokens' log-probabilities, shape (batch,)."""
        self._last: Any = None
        """The log-probabilities of the last call (the position whose token ``generate`` drew last)."""

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if self._last is not None:
            self.chosen.append(self._last.gather(1, input_ids[:, -1:]).squeeze(1))
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, completion_ids: list[list[int]]) -> list[list[float | None]]:
        """Each row's generated tokens' log-probabilities, given the completions ``generate`` made (cut after
        their end token); None where a position was not seen (never the case with transformers' sampling
        loop, but a loop that drew tokens elsewhere yields no numbers rather than wrong ones)."""
        chosen = [c.tolist() for c in self.chosen]
        last = self._last
        rows: list[list[float | None]] = []
        for i, ids in enumerate(completion_ids):
            row: list[float | None] = [c[i] for c in chosen[: len(ids)]]
            if len(ids) == len(chosen) + 1 and last is not None:
                row.append(float(last[i, ids[-1]]))
            rows.append(row + [None] * (len(ids) - len(row)))
        self.chosen, self._last = [], None
        return rows


@contextmanager
def recording(model: Any, recorder: SampledLogprobs) -> Any:
    """``generate`` calls of ``model`` (a PEFT model or a transformers one) inside the block run ``recorder``
    after all of their logits processors and warpers (transformers merges a caller's processors before its
    warpers, so passing it to ``generate`` would show it the scores before temperature and truncation)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    build = inner._get_logits_processor

    def with_recorder(*args: Any, **kwargs: Any) -> Any:
        processors = build(*args, **kwargs)
        processors.append(recorder)
        return processors

    inner._get_logits_processor = with_recorder
    try:
        yield
    finally:
        del inner._get_logits_processor


def measured_trainer_class(base: type) -> type:
    """``base`` (a ``GRPOTrainer``) that records the sampler's log-probabilities where it generates with
    ``generate`` and reports the ``mismatch/*`` numbers of every loss computation."""

    class MismatchMeasured(base):
        _mismatch_inputs: dict[str, Any] | None = None

        def _generate_single_turn(self, prompt_ids: Any, *args: Any, **kwargs: Any) -> Any:
            if self.use_vllm or self.use_transformers_continuous_batching:
                return super()._generate_single_turn(prompt_ids, *args, **kwargs)  # vLLM gives its own
            recorder = SampledLogprobs()
            with recording(self.accelerator.unwrap_model(self.model_wrapped), recorder):
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            # Every rank returns numbers (None entries become NaN and are left out): the comparison gathers
            # across ranks, so all of them must make it.
            return completion_ids, logprobs if logprobs is not None else recorder.finish(completion_ids)

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            self._mismatch_inputs = inputs
            try:
                return super()._compute_loss(model, inputs)
            finally:
                self._mismatch_inputs = None

        def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            inputs, self._mismatch_inputs = self._mismatch_inputs, None  # the loss's own pass, once
            if inputs is not None and inputs.get("sampling_per_token_logps") is not None:
                mask = inputs["completion_mask"]
                if "tool_mask" in inputs:
                    mask = mask * inputs["tool_mask"]
                mode = "train" if self.model.training else "eval"
                for name, value in self._mismatch(out[0], inputs["sampling_per_token_logps"], mask).items():
                    self._metrics[mode][PREFIX + name].append(value)
            return out

        def _mismatch(self, trainer_logps: Any, sampler_logps: Any, mask: Any) -> dict[str, float]:
            import torch

            with torch.no_grad():
                diff = trainer_logps.detach().float() - sampler_logps.float()
                valid = mask.bool() & torch.isfinite(diff)
                diff = diff[valid]
                clamped = diff.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
                ratio = torch.exp(clamped)
                n = float(diff.numel())
                sums = torch.stack(
                    [diff.abs().sum(), ratio.sum(), (-diff).sum(), torch.tensor(n, device=diff.device)]
                )
                sums = self.accelerator.reduce(sums, reduction="sum")
                empty = torch.tensor(0.0, device=diff.device)
                extremes = torch.stack(
                    [
                        diff.abs().max() if n else empty,
                        ratio.max() if n else empty,
                        -ratio.min() if n else empty,
                        torch.tensor(n, device=diff.device),
                    ]
                )
                gathered = self.accelerator.gather(extremes).view(-1, 4)
                present = gathered[gathered[:, 3] > 0]
            count = float(sums[3])
            if count == 0:
                return {}
            return {
                "logprob_diff_mean": float(sums[0]) / count,
                "logprob_diff_max": float(present[:, 0].max()),
                "ratio_mean": float(sums[1]) / count,
                "ratio_min": -float(present[:, 2].max()),
                "ratio_max": float(present[:, 1].max()),
                "kl": float(sums[2]) / count,
            }

    MismatchMeasured.__name__ = MismatchMeasured.__qualname__ = f"MismatchMeasured{base.__name__}"
    return MismatchMeasured

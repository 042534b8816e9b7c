"""`POST /v1/tinker/estimate`: what a Tinker training loop of a given shape would cost, before it runs.

The loop's tokens are counted as the server meters them: a `forward_backward` or `forward` pass on its data's
input tokens (the length of each datum's `model_input`), billed as prompt tokens of the base model; a sample
request on its prompt once, however many samples it asks for, and on each sample's generated tokens. They
are priced from the organisation's price table (`gateway.usage.pricing`), as billing and the billing report
(`gateway.tinker.billing`) price them, and held against what its monthly budget and the key's spend limit
have left (`gateway.jobs.cost.spend_verdict`). Nothing is stored.
"""

from __future__ import annotations

from gateway.deps import Resources
from gateway.errors import InvalidRequest
from gateway.jobs.cost import budget_state, spend_verdict
from gateway.jobs.protocol import Assumption, CostRange
from gateway.tenancy.keys import Principal
from gateway.tinker import owned
from gateway.tinker.billing_protocol import TinkerEstimate, TinkerEstimateRequest, TinkerRates, TinkerTokens
from gateway.usage.pricing import input_cost, output_cost


def _exact(value: float) -> CostRange:
    return CostRange(low=value, expected=value, high=value)


def _usd(low: float, expected: float, high: float) -> CostRange:
    """USD to a billionth of a dollar: a small loop's cost keeps its digits, sums lose their float noise."""
    return CostRange(low=round(low, 9), expected=round(expected, 9), high=round(high, 9))


async def estimate(res: Resources, who: Principal, body: TinkerEstimateRequest) -> TinkerEstimate:
    """The estimate of a loop of `body`'s shape (see the module)."""
    owned.known_base(res, body.base_model)
    if body.forward_backward is None and body.forward is None and body.sampling is None:
        raise InvalidRequest(
            "Give at least one of forward_backward, forward and sampling.", param="forward_backward"
        )
    base, settings = body.base_model, res.settings
    trained = sum(
        p.datums_per_step * p.tokens_per_datum for p in (body.forward_backward, body.forward) if p is not None
    )
    prefill = sample_low = sample_expected = sample_high = 0
    s = body.sampling
    if s is not None:
        expected = s.max_tokens if s.completion_tokens is None else s.completion_tokens
        if expected > s.max_tokens:
            raise InvalidRequest(
                "completion_tokens must be at most max_tokens.",
                param="sampling.completion_tokens",
                code="invalid_value",
            )
        prefill = s.prompts_per_step * s.prompt_tokens
        samples = s.prompts_per_step * s.samples_per_prompt
        sample_expected, sample_high = samples * expected, samples * s.max_tokens

    def step_usd(sampled: int) -> float:
        return input_cost(settings, base, trained + prefill) + output_cost(settings, base, sampled)

    per_step = (step_usd(sample_low), step_usd(sample_expected), step_usd(sample_high))
    steps = body.steps
    total = tuple(
        input_cost(settings, base, (trained + prefill) * steps) + output_cost(settings, base, sampled * steps)
        for sampled in (sample_low, sample_expected, sample_high)
    )
    verdict = await spend_verdict(
        res, who.organization_id, who.api_key_id, total[1], read_spend=True, what="loop"
    )
    price = settings.price_of(base)
    return TinkerEstimate(
        base_model=base,
        steps=steps,
        tokens=TinkerTokens(
            training=_exact(trained * steps),
            sampling_prefill=_exact(prefill * steps),
            sampling_sample=CostRange(
                low=sample_low * steps, expected=sample_expected * steps, high=sample_high * steps
            ),
        ),
        rates_usd_per_million_tokens=TinkerRates(
            training=price.input_per_million,
            sampling_prefill=price.input_per_million,
            sampling_sample=price.output_per_million,
        ),
        cost=_usd(*total),
        cost_per_step=_usd(*per_step),
        budget=budget_state(verdict),
        allowed=verdict.allowed,
        refusal=verdict.refusal,
        assumptions=ASSUMPTIONS,
    )


ASSUMPTIONS = [
    Assumption(
        name="training_rate",
        value="input_per_million",
        detail="Tinker forward and forward_backward tokens are metered and billed as prompt tokens of the "
        "base model.",
    ),
    Assumption(
        name="prompt_per_request",
        value=True,
        detail="A sample request's prompt is counted once, however many samples it asks for.",
    ),
    Assumption(
        name="sampled_tokens",
        value="0 / completion_tokens / max_tokens",
        detail="Low: every sample stops at once; expected: completion_tokens a sample; high: max_tokens.",
    ),
    Assumption(
        name="not_priced",
        value=["checkpoint", "storage", "optim_step"],
        detail="Saving checkpoints, keeping them and optimizer steps have no price here.",
    ),
]
"""What every estimate assumes."""

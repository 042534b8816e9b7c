"""A fine-tuning job's method, typed: supervised, dpo or reinforcement, each with its hyperparameters (the
training contract's own request models, `trainer.contract.REQUEST`: `"auto"` or a number), and for
reinforcement its grader or its environment.

One `JobMethod` goes from the create (`gateway.jobs.validation.parse_method`) to the row (`JobRow.method`,
parsed when a store reads the row) to the worker (the trainer's spec, the devices it claims). Its wire and
stored shape is OpenAI's, `{"type": <type>, <type>: {"hyperparameters": {...}, "grader": ...}}`
(`stored`), the same whether the hyperparameters are as given or resolved.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, TypeAdapter, field_validator

from trainer.contract import REQUEST


class EnvironmentRef(BaseModel):
    """A reinforcement job's environment: an uploaded package (a file of purpose `environment`) and its
    configuration."""

    model_config = ConfigDict(extra="forbid")

    file_id: str
    config: dict[str, Any] = Field(default_factory=dict)


class _Body(BaseModel):
    """What every method holds: its hyperparameters, as given (`"auto"` allowed) or resolved."""

    KIND: ClassVar[str]
    hyperparameters: SerializeAsAny[BaseModel] = Field(default=None, validate_default=True)
    """The method's `trainer.contract.REQUEST` model (`"auto"` or numbers), or its resolved model."""

    @field_validator("hyperparameters", mode="before")
    @classmethod
    def _of_the_method(cls, value: Any) -> BaseModel:
        if isinstance(value, BaseModel):
            return value
        return REQUEST[cls.KIND].model_validate(value or {})  # none given: every one "auto"


class SupervisedBody(_Body):
    KIND = "supervised"


class DpoBody(_Body):
    KIND = "dpo"


class ReinforcementBody(_Body):
    KIND = "reinforcement"
    grader: dict[str, Any] | None = None
    """An OpenAI grader (`envsdk.graders`); exactly one of it and `environment` (checked at create)."""
    environment: EnvironmentRef | None = None


class _Method(BaseModel):
    type: str

    @property
    def body(self) -> _Body:
        body: _Body = getattr(self, self.type)
        return body

    @property
    def hyperparameters(self) -> BaseModel:
        return self.body.hyperparameters

    @property
    def grader(self) -> dict[str, Any] | None:
        return getattr(self.body, "grader", None)

    @property
    def environment(self) -> EnvironmentRef | None:
        return getattr(self.body, "environment", None)

    @property
    def gpus(self) -> int:
        """The devices the job trains on (1 while `"auto"` is not resolved, or for a job made before they
        were counted)."""
        gpus = getattr(self.hyperparameters, "gpus", 1)
        return gpus if isinstance(gpus, int) and gpus > 0 else 1

    def with_hyperparameters(self, hyperparameters: BaseModel) -> JobMethod:
        """The same method with other hyperparameters (resolved)."""
        body = self.body.model_copy(update={"hyperparameters": hyperparameters})
        return METHOD.validate_python({"type": self.type, self.type: body})

    def stored(self) -> dict[str, Any]:
        """The job's `method` as stored and shown: the hyperparameters (as given, or resolved) and the
        reward, each only when there is one."""
        body: dict[str, Any] = {
            "hyperparameters": self.hyperparameters.model_dump(exclude_none=True, exclude_unset=True)
        }
        if self.grader is not None:
            body["grader"] = self.grader
        if self.environment is not None:
            body["environment"] = self.environment.model_dump()
        return {"type": self.type, self.type: body}


class SupervisedMethod(_Method):
    type: Literal["supervised"] = "supervised"
    supervised: SupervisedBody = Field(default_factory=SupervisedBody)


class DpoMethod(_Method):
    type: Literal["dpo"] = "dpo"
    dpo: DpoBody = Field(default_factory=DpoBody)


class ReinforcementMethod(_Method):
    type: Literal["reinforcement"] = "reinforcement"
    reinforcement: ReinforcementBody = Field(default_factory=ReinforcementBody)


JobMethod = Annotated[SupervisedMethod | DpoMethod | ReinforcementMethod, Field(discriminator="type")]
METHOD: TypeAdapter[SupervisedMethod | DpoMethod | ReinforcementMethod] = TypeAdapter(JobMethod)


def as_method(value: JobMethod | Mapping[str, Any]) -> JobMethod:
    """A method, from itself or from its stored shape (a row's JSON)."""
    if isinstance(value, _Method):
        return value
    return METHOD.validate_python(value)

"""The schema of a ledger entry: pydantic models, checked on every entry the ledger loads and on every
entry a run writes.

Its reasoning: docs/ledger.md, "vitexp/ledger/schema.py".
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Dict, Iterable, List, Literal, Optional, Union

from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    confloat,
    field_validator,
    model_validator,
)
from typing_extensions import TypeAliasType


class Status(str, Enum):
    """``interrupted``: closed by a signal (SIGINT, SIGTERM), or a running attempt found dead on resume."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


class Kind(str, Enum):
    TRAIN = "train"
    FLOPS = "flops"
    BENCH = "bench"
    EVAL = "eval"
    AUDIT = "audit"
    ANALYZE = "analyze"
    REHEARSAL = "rehearsal"
    REBUILD = "rebuild"


STATUSES = tuple(s.value for s in Status)
FINAL_STATUSES = ("completed", "failed", "interrupted")
KINDS = tuple(k.value for k in Kind)
#: Seconds a ``started`` may lie ahead of this machine's clock (another node's clock) before the entry is
#: broken.
CLOCK_SKEW_S = 300
#: The groups every run's config has (``conf/train.yaml``'s defaults that every run composes): a train
#: entry's config holds each, as an object (and a config that holds them is fingerprinted).
RUN_GROUPS = ("backbone", "method", "budget", "data", "recipe", "trainer")
#: How a path outside the checkout and the results root is stored: named with the machine it is on
#: (RFC 8089's file URI with a host), ``file://<host>/<absolute path>``.
MACHINE_PATH = "file://"


def _iso_only(value: Any) -> Any:
    """A time is an ISO 8601 text (or a datetime handed in), never a number read as a Unix time."""
    if isinstance(value, (str, _dt.datetime)):
        return value
    raise ValueError(f"{value!r} is not an ISO 8601 time")


#: A time of an entry: ISO 8601 with its zone (written in UTC).
Time = Annotated[AwareDatetime, BeforeValidator(_iso_only)]
FiniteFloat = confloat(strict=True, allow_inf_nan=False)
#: A metric: a finite number, a string, a boolean, null, or a list or object of metrics.
Metric = TypeAliasType(
    "Metric",
    Union[
        StrictBool, StrictInt, FiniteFloat, StrictStr, None, List["Metric"], Dict[str, "Metric"]  # noqa: F821
    ],
)


class RunConfig(BaseModel):
    """A run's resolved config: every group a run composes is there (other keys as they are)."""

    model_config = ConfigDict(extra="allow")
    backbone: Dict[str, Any]
    method: Dict[str, Any]
    budget: Dict[str, Any]
    data: Dict[str, Any]
    recipe: Dict[str, Any]
    trainer: Dict[str, Any]


class Attempt(BaseModel):
    """An earlier attempt of a resumed run."""

    model_config = ConfigDict(extra="allow")
    started: Optional[Time] = None
    finished: Optional[Time] = None
    status: Optional[Status] = None


class _Entry(BaseModel):
    model_config = ConfigDict(extra="allow")
    run_id: StrictStr
    experiment: StrictStr
    status: Status
    started: Time
    finished: Optional[Time] = None
    heartbeat: Optional[Time] = None
    metrics: Dict[str, Metric] = Field(default_factory=dict)
    protocol: Dict[str, Any] = Field(default_factory=dict)
    env: Dict[str, Any] = Field(default_factory=dict)
    artifacts: Dict[str, Any] = Field(default_factory=dict)
    attempts: List[Attempt] = Field(default_factory=list)
    error: Optional[StrictStr] = None
    wandb_url: Optional[StrictStr] = None
    wandb_id: Optional[StrictStr] = None
    wandb_name: Optional[StrictStr] = None
    wandb_error: Optional[StrictStr] = None
    output_dir: Optional[StrictStr] = None
    evaluates: Optional[StrictStr] = None
    fingerprint: Optional[StrictStr] = None
    signal: Optional[StrictStr] = None
    resumed_from: Optional[Dict[str, Any]] = None

    @field_validator("started")
    @classmethod
    def _not_ahead(cls, then: _dt.datetime, info: ValidationInfo) -> _dt.datetime:
        now = (info.context or {}).get("now") or _dt.datetime.now(_dt.timezone.utc)
        if (then - now).total_seconds() > CLOCK_SKEW_S:
            raise ValueError(
                f"started {then.isoformat()} is in the future (this machine's clock says"
                f" {now.isoformat(timespec='seconds')})"
            )
        return then

    @field_validator("run_id")
    @classmethod
    def _named_by_file(cls, run_id: str, info: ValidationInfo) -> str:
        stem = (info.context or {}).get("stem")
        if stem is not None and run_id != stem:
            raise ValueError(f"run_id {run_id!r} is not the file's name {stem!r}")
        return run_id

    @model_validator(mode="before")
    @classmethod
    def _no_machine_path(cls, record: Any) -> Any:
        if isinstance(record, dict):
            where = machine_bound(record)
            if where:
                raise ValueError(f"{where}: {MACHINE_PATH}<host>/<path>, or relative to the results root")
        return record


class TrainEntry(_Entry):
    kind: Literal["train"]
    config: RunConfig


class OtherEntry(_Entry):
    kind: Literal["flops", "bench", "eval", "audit", "analyze", "rehearsal", "rebuild"]
    config: Dict[str, Any] = Field(default_factory=dict)


#: One entry, its kind deciding its model.
ENTRY = TypeAdapter(Annotated[Union[TrainEntry, OtherEntry], Field(discriminator="kind")])
METRICS = TypeAdapter(Dict[str, Metric])


def machine_bound(value: Any, where: str = "") -> str | None:
    """Where ``value`` (an entry, at any depth) holds a path bound to one machine: an absolute path
    (``/...``, ``offline:/...``) or a ``file:///`` URL (no host); ``None`` when it holds none. An error
    text is a text: only a ``file:///`` URL in it counts. (A ``..`` path up to the file system's root,
    ``../../../usr/...``, is one too, but only the folder it was written in says so: writers name such
    a path with its machine, and ``scripts/migrate_ledger.py`` rewrote the committed ones.)"""
    if isinstance(value, str):
        bare = value[8:] if value.startswith("offline:") else value
        if "file:///" in value or (where.rpartition(".")[2] != "error" and bare.startswith("/")):
            return f"{where or 'the entry'} {value[:120]!r} is a path of one machine"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (str, dict, list)):
                found = machine_bound(item, f"{where}.{key}" if where else str(key))
                if found:
                    return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, dict, list)):
                found = machine_bound(item, f"{where}[{i}]")
                if found:
                    return found
    return None


@dataclass(frozen=True)
class BrokenEntry:
    """A ledger file that could not be used: its name and what is wrong; ``record`` is what parsed
    (``None`` when the file did not parse), so a table can tell whether it names one of its rows."""

    path: str
    problem: str
    record: dict[str, Any] | None = None

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


class LedgerError(ValueError):
    """Broken ledger entries where a command needs a whole ledger; the message names every file
    and what is wrong with it."""

    def __init__(self, broken: Iterable[BrokenEntry], what: str = "the ledger"):
        self.broken = list(broken)
        names = "; ".join(str(b) for b in self.broken[:10])
        more = f" (and {len(self.broken) - 10} more)" if len(self.broken) > 10 else ""
        super().__init__(
            f"{len(self.broken)} broken ledger entr{'y' if len(self.broken) == 1 else 'ies'} in "
            f"{what}: {names}{more}"
        )


TIMES = ("started", "finished", "heartbeat")


def _finite(value: Any) -> bool:
    """Whether every float in ``value`` (at any depth) is finite: what names a metric's error."""
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def _at(value: Any, loc: tuple) -> Any:
    for step in loc:
        try:
            value = value[step]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def _explain(record: dict[str, Any], err: dict[str, Any]) -> str:
    """One pydantic error in the ledger's words."""
    loc, kind = err["loc"], err["type"]
    if loc and loc[0] in ("train", "flops", "bench", "eval", "audit", "analyze", "rehearsal", "rebuild"):
        loc = loc[1:]  # the discriminated union's tag
    if kind == "union_tag_invalid":
        return f"kind {record.get('kind')!r} is not one of {list(KINDS)}"
    if kind == "union_tag_not_found":
        return "no 'kind'"
    if not loc:
        return err["msg"].removeprefix("Value error, ")
    top = loc[0]
    if kind == "missing":
        return f"no {'.'.join(map(str, loc))!r}"
    value = _at(record, loc)
    if top == "metrics" and len(loc) >= 2:  # one line per metric, whichever branch of Metric said it
        name, metric = loc[1], _at(record, loc[:2])
        if not _finite(metric):
            return f"metric {name!r} holds {metric!r}: not a finite number"
        kind_of = type(metric).__name__
        return f"metric {name!r} is {kind_of}: not a number, string, boolean, null, list or object"
    if top == "status" and kind == "enum":
        return f"status {value!r} is not one of {list(STATUSES)}"
    if top in TIMES or (top == "attempts" and loc[-1] in TIMES):
        where = ".".join(map(str, loc))
        if kind == "value_error":
            said = err["msg"].removeprefix("Value error, ")
            return said if said.startswith(where) else f"{where} {said}"
        if kind == "timezone_aware":
            return f"{where} {value!r} names no time zone"
        return f"{where} {value!r} is not an ISO 8601 time"
    if kind == "value_error":
        return err["msg"].removeprefix("Value error, ")
    where = ".".join(map(str, loc))
    return f"{where!r} is {type(value).__name__}: {err['msg'][:1].lower()}{err['msg'][1:]}"


def problems(record: Any, stem: str | None = None, now: _dt.datetime | None = None) -> list[str]:
    """What breaks the schema in ``record`` (empty: nothing); ``stem``: the file's name without
    ``.json``, which must be the ``run_id``."""
    if not isinstance(record, dict):
        return [f"not a JSON object but {type(record).__name__}"]
    try:
        ENTRY.validate_python(record, context={"stem": stem, "now": now})
    except ValidationError as err:
        return _explained(record, err)
    return []


def _explained(record: dict[str, Any], err: ValidationError, prefix: tuple = ()) -> list[str]:
    """Each pydantic error of ``err`` in the ledger's words, once; a config's missing groups in one."""
    errors = [{**e, "loc": (*prefix, *e["loc"])} for e in err.errors(include_url=False)]
    groups = [e["loc"][-1] for e in errors if e["type"] == "missing" and e["loc"][-2:-1] == ("config",)]
    out = [_explain(record, e) for e in errors if not (e["type"] == "missing" and e["loc"][-1] in groups)]
    if groups:
        out.append(
            f"config has no {', '.join(map(str, groups))}: not a run's config (a train entry's config"
            f" holds every group a run composes: {', '.join(RUN_GROUPS)})"
        )
    return list(dict.fromkeys(out))


def validated(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as a run writes it: checked (``ValueError`` naming what is wrong) and its times in UTC."""
    try:
        entry = ENTRY.validate_python(record)
    except ValidationError as err:
        wrong = "; ".join(_explained(record, err))
        raise ValueError(f"ledger entry {record.get('run_id')}: {wrong}") from None
    out = dict(record)
    for key in ("started", "finished", "heartbeat"):
        if getattr(entry, key, None) is not None:
            out[key] = utc(getattr(entry, key))
    if record.get("attempts"):
        out["attempts"] = [
            {**a, **{k: utc(getattr(m, k)) for k in ("started", "finished") if getattr(m, k) is not None}}
            for a, m in zip(record["attempts"], entry.attempts)
        ]
    return out


def utc(then: _dt.datetime) -> str:
    """A time as the ledger writes it: ISO 8601 in UTC (``+00:00``)."""
    return then.astimezone(_dt.timezone.utc).isoformat()


def bad_metrics(metrics: dict[str, Any]) -> list[str]:
    """What is wrong with ``metrics`` (a run's, before it closes), each naming its metric."""
    try:
        METRICS.validate_python(metrics)
    except ValidationError as err:
        return _explained({"metrics": metrics}, err, ("metrics",))
    return []


def started_at(stamp: str) -> _dt.datetime:
    """``started`` as a time (UTC when it names no zone, as W&B's ``created_at``); ``ValueError`` when it is
    none."""
    then = _dt.datetime.fromisoformat(stamp)
    return then if then.tzinfo is not None else then.replace(tzinfo=_dt.timezone.utc)

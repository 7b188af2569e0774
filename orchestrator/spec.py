"""The job spec: train.yaml as pydantic models, and a loader whose errors name file, line and field.

train.yaml feels like a SkyPilot task (`run`, `setup`, `envs`, `num_nodes`,
`resources.accelerators: H100:8`, `use_spot`). Flexible user forms (`H100:8` or a list or a
mapping, `16+`, `1h30m`) are normalized by before-validators into one stored form, so a loaded
spec round-trips through JSON (the job store keeps it as JSON) and each bad field gives exactly one
message. `load_spec` never lets anything but `SpecError` escape, whatever the file holds.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import reprlib
from typing import Annotated, Any, Callable, Literal, Mapping, Sequence, get_args

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      ValidationError, ValidationInfo, field_validator, model_validator)
from pydantic_core import InitErrorDetails

from providers.identity import identity_problem

PROVIDERS = ("local", "aws", "gcp", "azure", "kubernetes", "skypilot")
MAX_FILE_BYTES = 4 << 20        # a train.yaml is a few KiB; refuse to parse anything huge

# Upper bounds of every count and size (README's train.yaml section lists them). Each is far above any
# real job, and low enough that a typo (an extra digit, a pasted blob) is refused at once instead of
# making the controller create nodes, restarts or files without end.
MAX_NODES = 4096                # 4096 nodes x 8 GPUs is 32k GPUs, the largest training clusters built
MAX_PROCS_PER_NODE = 256        # one worker per GPU (8-16) or per core: the largest CPU instances have 192 vCPUs
MAX_ACCELERATORS_PER_NODE = 64  # nodes hold 8 (16 on a few); no machine of any catalog holds 64
MAX_STEPS = 10**9               # a billion optimizer steps: three years at 10 steps a second
MAX_RESTARTS = 1000             # each restart costs minutes; a job failing this often needs a person
MAX_SPARES = 256                # standby nodes: over 5% of the largest job
MAX_CPUS = 4096                 # vCPUs per node: the largest instances have under 2000
MAX_MEMORY_GIB = 65536          # GiB per node: the largest instances have 32 TiB
MAX_CHECKPOINTS_KEPT = 1000     # checkpoints kept on storage
MAX_INTERVAL_S = 30 * 86400     # a checkpoint at least every 30 days
MAX_HEARTBEAT_TIMEOUT_S = 86400  # a node silent for a day is gone
MAX_SCRIPT = 16384              # characters of `run` or `setup`: under 64 KiB of UTF-8, within Linux's
                                # 128 KiB limit on one argument (the agent runs `bash -c SCRIPT`)
MAX_ENVS = 128                  # envs, each value at most MAX_ENV_VALUE characters: 1 MiB of ASCII at
MAX_ENV_VALUE = 8192            # most, under Linux's 2 MiB for a worker's arguments and environment
MAX_ENV_NAME = 256
MAX_PATH = 4096                 # Linux's PATH_MAX: workdir, checkpoint.dir
MAX_LINE = 1024                 # other text: a region, an image, a label or toleration key or value
MAX_ITEMS = 64                  # entries of a list or mapping: accelerators, infra, regions, labels, tolerations

_NAME_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]{0,62}$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ACC_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_NUMBER_RE = re.compile(r"\d+(?:\.\d+)?|\.\d+")
# $NAME or ${NAME}; group 3: a form not filled in, refused (a shell's ${NAME:-default}, a pod command's $(NAME))
_PATH_VARIABLE_RE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*)"
                               r"|(\{[^}]*\}?|\([^)]*\)?))")
# each unit as people write it ("30sec", "5 min", "2 hours", "1 day"), longest spelling first for the regex
_UNIT_NAMES = {"ms": ("milliseconds", "millisecond", "msecs", "msec", "ms"),
               "s": ("seconds", "second", "secs", "sec", "s"), "m": ("minutes", "minute", "mins", "min", "m"),
               "h": ("hours", "hour", "hrs", "hr", "h"), "d": ("days", "day", "d")}
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SECONDS_OF_UNIT = {name: _UNIT_SECONDS[unit] for unit, names in _UNIT_NAMES.items() for name in names}
_UNIT = "(?:" + "|".join(sorted(_SECONDS_OF_UNIT, key=len, reverse=True)) + ")"
_DURATION_RE = re.compile(rf"(?:\s*(?:\d+(?:\.\d+)?|\.\d+)\s*{_UNIT}(?![a-z]))+\s*")
_DURATION_PART_RE = re.compile(rf"(\d+(?:\.\d+)?|\.\d+)\s*({_UNIT})(?![a-z])")
_DURATION_FIX = "To fix: use seconds (30) or a number with a unit s, m, h or d, e.g. '30s', '10m', '1h30m'"

_repr = reprlib.Repr()   # short, one-line and safe on deep or self-referencing values
_repr.maxstring = _repr.maxother = 40
_repr.maxlevel, _repr.maxlist, _repr.maxdict = 2, 4, 4


def _show(value: Any) -> str:
    try:
        return _repr.repr(value)
    except Exception:                               # e.g. an int too long to print
        return f"<{type(value).__name__}>"


# Control characters (C0, DEL, C1): a NUL in an environment value or a command makes every agent that
# starts the job fail; the others garble logs and shells. Scripts keep tab and newline. (Lone surrogates
# never get this far: a strict str field refuses them.)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SCRIPT_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _no_control(pattern: re.Pattern[str]) -> Callable[[str], str]:
    def check(value: str) -> str:
        found = pattern.search(value)
        if found:
            kind = "a line break" if found.group() in "\n\r" else "a control character"
            raise ValueError(f"{kind} (U+{ord(found.group()):04X}) at character {found.start() + 1} is not "
                             "allowed here. To fix: remove it")
        return value
    return check


def bounded_text(max_length: int, multiline: bool = False, min_length: int = 0) -> Any:
    """A str field of at most `max_length` characters and no control character (tab and newline only
    where `multiline`), so that nothing the spec holds can break the agents that use it."""
    return Annotated[str, Field(strict=True, min_length=min_length or None, max_length=max_length),
                     AfterValidator(_no_control(_SCRIPT_CONTROL_RE if multiline else _CONTROL_RE))]


Line = bounded_text(MAX_LINE)
PathText = bounded_text(MAX_PATH)
Script = bounded_text(MAX_SCRIPT, multiline=True)


def close_match(word: str, choices: Sequence[str], cutoff: float = 0.6) -> str | None:
    """The choice that `word` most likely misspells (case aside), for a "did you mean" hint; or None. `cutoff`: how
    alike they must be (difflib's ratio)."""
    folded = {choice.casefold(): choice for choice in choices}
    close = difflib.get_close_matches(word.casefold(), list(folded), n=1, cutoff=cutoff)
    return folded[close[0]] if close else None


def parse_duration(value: str | int | float) -> float:
    """Seconds in `value` ("30s", "10m", "1h30m", "250ms", "2d", or a plain number of seconds).

    One grammar for every duration in the spec, so `interval` and `heartbeat_timeout` agree.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{_show(value)} is not a duration. {_DURATION_FIX}")
    if isinstance(value, str):
        text = value.strip().lower()
        if _NUMBER_RE.fullmatch(text):
            seconds = float(text)
        elif _DURATION_RE.fullmatch(text):
            seconds = sum(float(n) * _SECONDS_OF_UNIT[u] for n, u in _DURATION_PART_RE.findall(text))
        else:
            raise ValueError(f"invalid duration {_show(value)}. {_DURATION_FIX}")
    else:
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"duration {_show(value)} must be a finite number >= 0. {_DURATION_FIX}")
    return seconds


def bounded_duration(value: Any, name: str, most_s: float, most_text: str) -> float:
    """A duration field in seconds, longer than zero and at most `most_s` (said as `most_text`)."""
    seconds = parse_duration(value)
    if not 0 < seconds <= most_s:
        raise ValueError(f"{name} must be longer than zero and at most {most_text}. {_DURATION_FIX}")
    return seconds


class AcceleratorRequest(BaseModel):
    """One accelerator choice: `count` devices of type `name` per node (name as the user wrote it)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    count: int = Field(1, ge=1, le=MAX_ACCELERATORS_PER_NODE, strict=True)

    def matches(self, name: str) -> bool:
        """Accelerator names compare case-insensitively (h100 == H100), as in SkyPilot."""
        return self.name.casefold() == name.casefold()


class Amount(BaseModel):
    """A resource quantity: exactly `count`, or at least `count` when the user wrote "N+"."""

    model_config = ConfigDict(extra="forbid")
    count: float = Field(gt=0, allow_inf_nan=False, strict=True)
    at_least: bool = Field(False, strict=True)

    def __str__(self) -> str:
        return f"{self.count:g}{'+' if self.at_least else ''}"


_ACC_FIX = f"To fix: write it like 'H100:8' (NAME:COUNT, COUNT a whole number from 1 to {MAX_ACCELERATORS_PER_NODE})"


def _parse_accelerator(text: Any) -> tuple[str, int]:
    if not isinstance(text, str):
        raise ValueError(f"{_show(text)} is not an accelerator. {_ACC_FIX}")
    name, sep, count = (part.strip() for part in text.strip().partition(":"))
    if not _ACC_NAME_RE.fullmatch(name):
        raise ValueError(f"accelerator name {_show(name)} in {_show(text)} is not valid. {_ACC_FIX}")
    if not sep:
        return name, 1
    if re.fullmatch(r"\d{1,6}", count):
        return name, _accelerator_count(int(count), name)
    if re.fullmatch(r"\d*\.\d+", count):
        raise ValueError(f"fractional accelerator count {_show(count)} is not supported. {_ACC_FIX}")
    raise ValueError(f"accelerator count {_show(count)} in {_show(text)} is not a whole number >= 1. {_ACC_FIX}")


def whole_number_text(value: Any) -> Any:
    """A count written as text (`num_nodes: "2"`, `{A100: "8"}`: SkyPilot and dstack users quote them), in
    scientific notation (`steps: 1e6`, which YAML reads as text, and 1.0e6 as a float) or as a whole float (2.0) as
    the int it names; any other value (2.5) as it is, for the field's own check to take or refuse."""
    if isinstance(value, str) and re.fullmatch(r"\s*\d{1,18}\s*", value):
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*\d{1,6}(?:\.\d{1,6})?[eE]\+?\d{1,2}\s*", value):
        value = float(value)
    if isinstance(value, float) and value.is_integer():       # inf and nan are not
        return int(value)
    return value


def dollars_text(value: Any) -> Any:
    """A price written as text (`max_hourly_cost: "$40"`, `"40"`, `"40 USD"`, `"$2.50/hr"`) as the number of dollars
    it names; any other value as it is, for the field's own check to take or refuse."""
    if isinstance(value, str):
        price = re.fullmatch(r"\s*\$?\s*(\d{1,9}(?:\.\d{1,6})?|\.\d{1,6})\s*(?:usd)?\s*(?:/\s*(?:h|hr|hour))?\s*",
                             value.lower())
        if price:
            return float(price.group(1))
    return value


# Int fields that take "8" as 8 (the optional one so that its bounds stay in the JSON schema, the TfsnJob CRD's)
Count = Annotated[int, BeforeValidator(whole_number_text)]
OptionalCount = Annotated[int | None, BeforeValidator(whole_number_text)]


def _accelerator_count(count: Any, name: Any) -> int:
    count = whole_number_text(count)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_ACCELERATORS_PER_NODE:
        raise ValueError(f"count {_show(count)} for {_show(name)} is not a whole number from 1 to "
                         f"{MAX_ACCELERATORS_PER_NODE} (accelerators per node). {_ACC_FIX}")
    return count


# Units of `memory`, in GiB: "32GB" (dstack's form) is 32 GiB, as the catalogs' MemoryGiB count it.
_MEMORY_UNITS = {"": 1.0, **{unit: scale for units, scale in (("m mb mib", 1 / 1024), ("g gb gib", 1.0),
                                                               ("t tb tib", 1024.0)) for unit in units.split()}}
_AMOUNT_RE = re.compile(r"(?P<number>\d+(?:\.\d+)?|\.\d+)\s*(?P<unit>[A-Za-z]*)")


def _parse_amount(value: Any, whole: bool) -> Any:
    """`value` ("16", "16+", 16, and for memory "32GB", "1TB+") as the stored form {count, at_least}."""
    fix = "To fix: write a number, or 'N+' for at least N, e.g. " + ("'4+'" if whole else "'16+' or '32GB+'")
    if value is None or isinstance(value, dict):    # dict: the stored form, or an error for Amount
        return value
    at_least, count = False, None
    if isinstance(value, str):
        text = value.strip()
        at_least = text.endswith("+")
        match = _AMOUNT_RE.fullmatch(text.removesuffix("+").strip())
        units = {"": 1.0} if whole else _MEMORY_UNITS
        if match and match["unit"].lower() in units:
            count = float(match["number"]) * units[match["unit"].lower()]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        count = float(value) if not isinstance(value, int) or value.bit_length() < 1000 else math.inf
    if count is None or not math.isfinite(count) or count <= 0:
        raise ValueError(f"{_show(value)} is not a positive amount. {fix}")
    if whole and count != int(count):
        raise ValueError(f"{_show(value)} is not a whole number of CPUs. {fix}")
    return {"count": count, "at_least": at_least}


def _at_most(amount: Amount | None, limit: int, unit: str) -> Amount | None:
    if amount is not None and amount.count > limit:
        raise ValueError(f"{amount.count:g} {unit} per node is more than the {limit} allowed. "
                         f"To fix: ask for at most {limit}")
    return amount


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class RemoteIdentity(BaseModel):
    """The identity each cloud's VMs run as (providers/identity.py): how a node's workers reach the job's bucket
    with the machine's own credentials, no key on the node (SkyPilot's `remote_identity`). Unset: no identity."""

    model_config = ConfigDict(extra="forbid")
    aws: Line | None = None       # IAM instance profile: NAME or arn:aws:iam::ACCOUNT:instance-profile/NAME
    gcp: Line | None = None       # service account email, attached with the cloud-platform scope
    azure: Line | None = None     # user-assigned managed identity: /subscriptions/.../userAssignedIdentities/NAME

    @field_validator("aws", "gcp", "azure")
    @classmethod
    def _well_formed(cls, value: str | None, info: ValidationInfo) -> str | None:
        problem = identity_problem(info.field_name, value) if value is not None else None
        if problem:
            raise ValueError(problem)
        return value


class Resources(BaseModel):
    """What each node needs. `accelerators` keeps the user's shape (str, list = ordered preference,
    mapping = any of them, the cheapest run wins), normalized to "NAME:COUNT" / {NAME: COUNT}."""

    model_config = ConfigDict(extra="forbid")
    accelerators: str | list[str] | dict[str, int] | None = None
    cpus: Amount | None = None                    # count is a whole number
    memory: Amount | None = None                  # GiB
    use_spot: bool = Field(False, strict=True)
    infra: list[str] | None = Field(None, max_length=MAX_ITEMS)   # allowed providers, in lower case
    regions: list[Line] | None = Field(None, max_length=MAX_ITEMS)
    max_hourly_cost: Annotated[float | None, BeforeValidator(dollars_text)] = Field(None, gt=0, allow_inf_nan=False,
                                                                                  strict=True)   # dollars
    remote_identity: RemoteIdentity | None = None   # what each cloud's VMs run as (reaches the bucket)

    @field_validator("accelerators", mode="before")
    @classmethod
    def _accelerators(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            return "%s:%d" % _parse_accelerator(value)
        if isinstance(value, (list, dict)) and len(value) > MAX_ITEMS:
            raise ValueError(f"{len(value)} accelerator choices; at most {MAX_ITEMS} are allowed. "
                             "To fix: keep the ones you would really run on")
        if isinstance(value, list):
            if not value:
                raise ValueError("empty list. To fix: list accelerators like [H100:8, A100:8], "
                                 "or remove the field for CPU only")
            return ["%s:%d" % _parse_accelerator(item) for item in value]
        if isinstance(value, dict):
            if not value:
                raise ValueError("empty mapping. To fix: write {H100: 8, A100: 8}, "
                                 "or remove the field for CPU only")
            out = {}
            for name, count in value.items():
                # SkyPilot's set form {H100, A100}: one each
                count = _accelerator_count(1 if count is None else count, name)
                name, _ = _parse_accelerator(name)
                out[name] = count
            return out
        raise ValueError(f"{_show(value)} is not an accelerator request. To fix: write 'H100:8', "
                         "a list [H100:8, A100:8] (ordered preference) or {H100: 8, A100: 8} (any)")

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpus(cls, value: Any) -> Any:
        return _parse_amount(value, whole=True)

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> Any:
        return _parse_amount(value, whole=False)

    @model_validator(mode="before")
    @classmethod
    def _infra_with_regions(cls, data: Any) -> Any:
        """SkyPilot's `infra: aws/us-east-1` (CLOUD/REGION) is infra [aws] and regions [us-east-1], and "gcp, aws"
        (as TFSN_CLOUDS is written) the list of both."""
        infra = data.get("infra") if isinstance(data, dict) else None
        items = [item.strip() for item in infra.split(",")] if isinstance(infra, str) else infra
        if not isinstance(items, list) or not any(isinstance(item, str) and "/" in item for item in items):
            return data if not isinstance(infra, str) else {**data, "infra": items}
        providers, regions = [], list(_as_list(data.get("regions")) or [])
        for item in items:
            cloud, _, where = item.partition("/") if isinstance(item, str) else (item, "", "")
            region, _, zone = where.partition("/")
            if zone:
                raise ValueError(f"infra: {_show(item)} names a zone; tfsn picks the zone within the region. To fix: "
                                 f"write {cloud}/{region}")
            providers.append(cloud)
            if region and region != "*" and region not in regions:
                regions.append(region)
        return {**data, "infra": providers, **({"regions": regions} if regions else {})}

    @field_validator("infra", mode="before")
    @classmethod
    def _infra(cls, value: Any) -> Any:
        value = _as_list(value)
        if not isinstance(value, list):
            return value
        if not value:
            raise ValueError("empty list. To fix: name providers like [aws, gcp], or remove the "
                             "field to allow all")
        out = []
        for item in value:
            name = item.strip().lower() if isinstance(item, str) else item
            name = {"k8s": "kubernetes"}.get(name, name) if isinstance(name, str) else name  # SkyPilot's name of it
            if not isinstance(name, str) or name not in PROVIDERS:   # a mapping or a list: unhashable
                close = close_match(str(name), PROVIDERS)
                hint = f"did you mean {close!r}? " if close else ""
                raise ValueError(f"unknown provider {_show(item)}; {hint}To fix: use one of "
                                 + ", ".join(PROVIDERS))
            out.append(name)
        return out

    @field_validator("regions", mode="before")
    @classmethod
    def _regions(cls, value: Any) -> Any:
        value = _as_list(value)
        if isinstance(value, list) and any(isinstance(r, str) and not r.strip() for r in value):
            raise ValueError("empty region name. To fix: write regions like [us-east-1]")
        return value

    @field_validator("cpus")
    @classmethod
    def _whole_cpus(cls, value: Amount | None) -> Amount | None:
        if value is not None and value.count != int(value.count):
            raise ValueError(f"{value.count:g} is not a whole number of CPUs. To fix: write e.g. '4+'")
        return _at_most(value, MAX_CPUS, "CPUs")

    @field_validator("memory")
    @classmethod
    def _memory_bound(cls, value: Amount | None) -> Amount | None:
        return _at_most(value, MAX_MEMORY_GIB, "GiB")

    def identity(self, provider: str) -> str:
        """The identity `provider`'s VMs run as; "" for none (or a provider that has no such thing)."""
        if provider not in RemoteIdentity.model_fields:
            return ""
        return getattr(self.remote_identity, provider, None) or ""

    @property
    def accelerators_any_of(self) -> bool:
        """True for the mapping form (any of them, cheapest run wins); False for str/list (ordered)."""
        return isinstance(self.accelerators, dict)

    def accelerator_choices(self) -> list[AcceleratorRequest]:
        """The choices in the user's order; empty when the job runs on CPUs only."""
        acc = self.accelerators
        if acc is None:
            return []
        if isinstance(acc, dict):
            return [AcceleratorRequest(name=n, count=c) for n, c in acc.items()]
        pairs = [_parse_accelerator(a) for a in _as_list(acc)]
        return [AcceleratorRequest(name=n, count=c) for n, c in pairs]


# Object stores a checkpoint.dir may name (through fsspec), and the extra that installs each driver.
CHECKPOINT_URL_SCHEMES = {"s3": "aws", "gs": "gcs", "az": "azblob"}     # scheme: the tfsn extra with its driver
CHECKPOINT_DRIVERS = {"s3": "s3fs", "gs": "gcsfs", "az": "adlfs"}        # scheme: the fsspec driver's module


def checkpoint_url_scheme(location: str | None) -> str | None:
    """'s3', 'gs' or 'az' when `location` is such an object-store URL; None for a path."""
    scheme, sep, _ = (location or "").partition("://")
    return scheme.lower() if sep and scheme.lower() in CHECKPOINT_URL_SCHEMES else None


class CheckpointSpec(BaseModel):
    """Where and how often to checkpoint: every N steps (int), every duration ("10m"), or "auto"."""

    model_config = ConfigDict(extra="forbid")
    dir: PathText | None = None                   # s3://, gs://, az:// URL, or a path (absolute once loaded)
    interval: int | str = "auto"
    keep: Count = Field(3, ge=1, le=MAX_CHECKPOINTS_KEPT, strict=True)
    async_save: bool = Field(True, strict=True)   # the step pays for the copy to memory only; writes go on behind
    local_ok: bool = Field(False, strict=True)    # a path is on storage every node shares (tfsn cannot tell)

    @field_validator("dir")
    @classmethod
    def _dir(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():     # "" was the workdir itself, checkpoints among the code
            raise ValueError("empty. To fix: name a folder or a bucket URL, or remove it for the default")
        slash_missing = re.match(r"(s3|gs|az):/?(?!/)", value or "", re.IGNORECASE)
        if slash_missing:                               # "gs:/bucket" was a folder "gs:" in workdir, not the bucket
            url = f"{slash_missing[1].lower()}://{value[slash_missing.end():]}"
            raise ValueError(f"{_show(value)} looks like a mistyped {url}. To fix: write {url} "
                             f"(or ./{value} for a folder of that name)")
        scheme = (value or "").partition("://")[0]
        if value is not None and "://" in value and checkpoint_url_scheme(value) is None:
            raise ValueError(f"{_show(scheme)}:// is not a storage tfsn checkpoints to. To fix: use s3://BUCKET/PATH, "
                             "gs://BUCKET/PATH, az://CONTAINER/PATH or a path")
        if checkpoint_url_scheme(value) and not value.partition("://")[2].strip("/"):
            raise ValueError(f"{_show(value)} names no bucket. To fix: write e.g. {scheme}://my-bucket/checkpoints")
        return value

    @field_validator("interval", mode="before")
    @classmethod
    def _interval(cls, value: Any) -> Any:
        fix = ("To fix: write steps as a whole number (500), a time with a unit ('10m'; at most "
               f"{MAX_INTERVAL_S // 86400} days), or 'auto'")
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, str) and re.fullmatch(r"\s*\d{1,18}\s*", value):
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if not 1 <= value <= MAX_STEPS:
                raise ValueError(f"interval {_show(value)} must be from 1 to {MAX_STEPS} steps. {fix}")
            return value
        if not isinstance(value, str) or _NUMBER_RE.fullmatch(value.strip()):
            raise ValueError(f"{_show(value)} is not a checkpoint interval. {fix}")
        if not 0 < parse_duration(value) <= MAX_INTERVAL_S:
            raise ValueError(f"interval {_show(value)} must be longer than zero and at most "
                             f"{MAX_INTERVAL_S // 86400} days. {fix}")
        return value.strip()

    @property
    def is_auto(self) -> bool:
        return self.interval == "auto"

    @property
    def interval_steps(self) -> int | None:
        return self.interval if isinstance(self.interval, int) else None

    @property
    def interval_seconds(self) -> float | None:
        if isinstance(self.interval, str) and not self.is_auto:
            return parse_duration(self.interval)
        return None


class RecoverySpec(BaseModel):
    """How many times to restart after a fault, and how many standby nodes to keep provisioned."""

    model_config = ConfigDict(extra="forbid")
    max_restarts: Count = Field(3, ge=0, le=MAX_RESTARTS, strict=True)
    spares: Count = Field(0, ge=0, le=MAX_SPARES, strict=True)


def _refused(model: str, loc: tuple, value: Any, problem: ValueError) -> ValidationError:
    """`problem` as the error of the field at `loc` (below the validator raising it), to name that field's line."""
    return ValidationError.from_exception_data(model, [InitErrorDetails(type="value_error", loc=loc, input=value,
                                                                        ctx={"error": problem})])


class HealthSpec(BaseModel):
    """Health knobs set per job; the rest of the policy lives in configs/."""

    model_config = ConfigDict(extra="forbid")
    heartbeat_timeout: float = 30.0               # seconds
    thresholds: dict[str, float] = {}             # overrides of configs/health.yaml's thresholds
    actions: dict[str, str] = {}                  # finding kind -> ignore|warn|checkpoint|replace_node|fail

    @field_validator("thresholds", mode="before")
    @classmethod
    def _durations(cls, value: Any) -> Any:
        """A threshold in seconds written as a duration with a unit ("2h" for phase_timeout_max_s, as every duration
        of the spec is written) in seconds; a duration where the threshold counts steps or samples refused, and a
        yes/no anywhere (a float field takes `hang_min_s: yes` as 1, past the policy's own refusal of a bool)."""
        from health.config import MEASURES, SECONDS
        if not isinstance(value, dict):
            return value
        out = dict(value)
        for name, written in value.items():
            duration = isinstance(written, str) and _DURATION_RE.fullmatch(written.strip().lower())
            if not (duration or (isinstance(written, bool) and name in MEASURES)):   # unknown: _policy says so
                continue
            measure = MEASURES.get(name, SECONDS)        # an unknown name: refused by _policy, with a "did you mean"
            if isinstance(written, bool) or measure != SECONDS:
                kind = "a duration" if duration else "yes/no"
                raise _refused(cls.__name__, (name,), written, ValueError(
                    f"{_show(written)} is {kind}, but {name} {measure}. To fix: write a number (see "
                    "configs/health.yaml), or remove it to keep the shipped value"))
            out[name] = parse_duration(written)
        return out

    @field_validator("thresholds", "actions")
    @classmethod
    def _policy(cls, value: dict, info: ValidationInfo) -> dict:
        """Checked against the health policy's own schema, so the two never drift apart."""
        from health.config import HealthConfig
        try:
            HealthConfig.load({info.field_name: value})
        except ValueError as err:
            raise ValueError(str(err).removeprefix(f"health.{info.field_name}").lstrip(".: ")) from None
        return value

    @field_validator("heartbeat_timeout", mode="before")
    @classmethod
    def _timeout(cls, value: Any) -> float:
        return bounded_duration(value, "heartbeat_timeout", MAX_HEARTBEAT_TIMEOUT_S,
                                f"{MAX_HEARTBEAT_TIMEOUT_S // 3600} hours")


class Toleration(BaseModel):
    """A Kubernetes toleration, as in a pod spec (key, operator, value, effect)."""

    model_config = ConfigDict(extra="forbid")
    key: Line | None = None
    operator: Literal["Equal", "Exists"] = "Equal"
    value: Line | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("operator Exists takes no value. To fix: drop `value`, or use operator: Equal")
        if self.operator == "Equal" and not self.key:
            raise ValueError("operator Equal needs a key. To fix: add `key: <taint key>`, or use operator: Exists")
        return self


ImageName = bounded_text(MAX_LINE, min_length=1)


class KubernetesSpec(BaseModel):
    """Where and how a job's pods run on Kubernetes (`infra: [kubernetes]`, or a TfsnJob): on top of
    the GPU selector and toleration tfsn derives from the planned offer."""

    model_config = ConfigDict(extra="forbid")
    image: ImageName | None = None                # None: TFSN_K8S_IMAGE, else providers.kubernetes.DEFAULT_IMAGE
    node_selector: dict[Line, Line] = Field({}, max_length=MAX_ITEMS)   # extra node labels every pod requires
    tolerations: list[Toleration] = Field([], max_length=MAX_ITEMS)     # extra taints every pod tolerates


_PARAMS_RE = re.compile(r"((?:\d+(?:\.\d+)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([kKmMbBtT]?)")
_PARAMS_UNIT = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


_ENTRY_RE = re.compile(r"^(?P<file>[^:\x00-\x1f]+\.py):(?P<function>[A-Za-z_][A-Za-z0-9_]*)$")
ENTRY_TIMEOUT_S = 300.0         # default `model.entry_timeout`: importing, building, capturing and searching
MAX_ENTRY_TIMEOUT_S = 3600.0
_SHAPE_FIELDS = ("params", "layers", "hidden", "seq_len", "batch_size")


class ModelSpec(BaseModel):
    """The model being trained, for the planner's step-time and memory estimates.

    `entry: train.py:build` names a function of the job's own code (a path relative to `workdir`) that
    returns `(model, batch, loss_fn)`: the module, one example batch of one rank (a tensor or a tuple of
    tensors; the first one's leading dimension is the per-rank batch size) and `loss_fn(model, batch)`
    returning the scalar loss (None: `model(*batch)` is the loss). The planner captures that training step
    and searches it per hardware type. The declared shape (a decoder-only transformer trained with Adam;
    `batch_size` is sequences per optimizer step, all ranks together) is the roofline fallback, and the
    whole model without an entry. Without this section the planner assumes its reference workload.
    """

    model_config = ConfigDict(extra="forbid")
    entry: Line | None = None                          # "train.py:build": FILE.py:FUNCTION, FILE under workdir
    entry_timeout: float = ENTRY_TIMEOUT_S         # seconds for importing the entry, capturing and searching
    # Bounds far above any model trained (1e12 parameters, 200 layers, 32k wide, 1M-token contexts)
    params: float | None = Field(None, gt=0, le=1e15, allow_inf_nan=False)  # 1.3e9, or "1.3B", "350M"
    layers: OptionalCount = Field(None, ge=1, le=10**5, strict=True)
    hidden: OptionalCount = Field(None, ge=1, le=1 << 20, strict=True)
    seq_len: OptionalCount = Field(None, ge=1, le=1 << 30, strict=True)
    batch_size: OptionalCount = Field(None, ge=1, le=1 << 30, strict=True)   # sequences, all ranks
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"

    @field_validator("params", mode="before")
    @classmethod
    def _params(cls, value: Any) -> Any:
        fix = "To fix: write a count like 1.3e9 or with a unit: '350M', '1.3B', '70B'"
        if isinstance(value, bool):
            raise ValueError(f"{_show(value)} is not a parameter count. {fix}")
        if isinstance(value, str):
            match = _PARAMS_RE.fullmatch(value.strip())
            if not match:
                raise ValueError(f"{_show(value)} is not a parameter count. {fix}")
            return float(match.group(1)) * _PARAMS_UNIT[match.group(2).lower()]
        if isinstance(value, int) and value.bit_length() >= 1000:
            raise ValueError(f"{_show(value)} is too large a parameter count. {fix}")
        return value

    @field_validator("entry")
    @classmethod
    def _entry(cls, value: str | None) -> str | None:
        if value is not None and not _ENTRY_RE.fullmatch(value.strip()):
            raise ValueError(f"{_show(value)} is not FILE.py:FUNCTION. To fix: name a function of your script, "
                             "relative to workdir, e.g. 'entry: train.py:build'")
        return None if value is None else value.strip()

    @field_validator("entry_timeout", mode="before")
    @classmethod
    def _entry_timeout(cls, value: Any) -> float:
        return bounded_duration(value, "entry_timeout", MAX_ENTRY_TIMEOUT_S, f"{MAX_ENTRY_TIMEOUT_S / 60:.0f} minutes")

    @model_validator(mode="after")
    def _entry_or_shape(self) -> ModelSpec:
        missing = [name for name in _SHAPE_FIELDS if getattr(self, name) is None]
        if self.entry is None and missing:
            raise ValueError(f"{', '.join(missing)} missing: the model is described by an entry or by its shape. "
                             "To fix: add 'entry: train.py:build' (a function returning model, batch, loss_fn), "
                             f"or all of {', '.join(_SHAPE_FIELDS)}")
        return self

    @property
    def has_shape(self) -> bool:
        """True when the declared shape is complete (the roofline can price it)."""
        return all(getattr(self, name) is not None for name in _SHAPE_FIELDS)

    def entry_parts(self) -> tuple[str, str]:
        """`entry` as (file, function)."""
        match = _ENTRY_RE.fullmatch(self.entry or "")
        if match is None:
            raise ValueError("the model has no entry")
        return match["file"], match["function"]


# What tfsn itself gives every worker, over the job's envs or under them (its agent's): a value in envs would be
# ignored (a checkpoint folder the script never sees), or would cut the workers off from their controller.
# Refused in a spec file or --env (load_spec), not by the model: a job stored by an older tfsn still loads.
_TFSN_SETS = {"TFSN_CHECKPOINT_DIR": "set checkpoint.dir instead", "TFSN_JOB_NAME": "set name instead",
              **{name: "remove it" for name in ("TFSN_ATTEMPT", "TFSN_NUM_NODES", "TFSN_TOKEN", "TFSN_JOB_ID",
                                                "TFSN_NODE_ID", "TFSN_CONTROLLER_URL")}}


def _env_name(key: str) -> str:
    if not _ENV_RE.fullmatch(key):
        raise ValueError(f"{_show(key)} is not a valid environment variable name. To fix: use "
                         "letters, digits and '_', not starting with a digit")
    return key


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() >= 4000:         # str() refuses ints of over 4300 digits
            raise ValueError(f"{_show(value)} is too large a number. To fix: quote it")
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"value {_show(value)} is not text, a number or a bool. To fix: quote "
                         "it here, or pass it with --env NAME=VALUE")
    return value


def env_list_as_mapping(items: list) -> dict[str, str]:
    """dstack's (and docker compose's) list form of the environment, [NAME=VALUE, ...], as the mapping it means."""
    mapping: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=") if isinstance(item, str) else ("", "", "")
        if not sep:
            raise ValueError(f"item {_show(item)} is not NAME=VALUE. To fix: write each item as NAME=VALUE (a value "
                             "given at launch: --env NAME=VALUE), or envs as a mapping, e.g. 'envs: {SEED: 1}'")
        if name in mapping:
            raise ValueError(f"{_show(name)} is given twice. To fix: keep only one")
        mapping[name] = value
    return mapping


EnvName = Annotated[str, Field(strict=True, max_length=MAX_ENV_NAME), AfterValidator(_env_name)]
# multiline: a value may be a PEM key
EnvValue = Annotated[bounded_text(MAX_ENV_VALUE, multiline=True), BeforeValidator(_env_value)]


class JobSpec(BaseModel):
    """A whole train.yaml. Paths are absolute str once loaded by `load_spec`."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(strict=True)                # load_spec defaults it to the file's stem
    num_nodes: Count = Field(1, ge=1, le=MAX_NODES, strict=True)
    nproc_per_node: int | Literal["auto"] = "auto"
    workdir: PathText = "."
    setup: Script | None = None
    run: Script
    envs: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=MAX_ENVS)
    steps: OptionalCount = Field(None, ge=1, le=MAX_STEPS, strict=True)
    resources: Resources = Field(default_factory=Resources)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    health: HealthSpec = Field(default_factory=HealthSpec)
    model: ModelSpec | None = None                # None: the planner's reference workload
    kubernetes: KubernetesSpec | None = None      # pod placement where the job runs on Kubernetes

    def placement(self, provider: str) -> dict[str, Any]:
        """The spec's own section for a provider (only `kubernetes` has one), as plain data."""
        section = self.kubernetes if provider == "kubernetes" else None
        return section.model_dump(exclude_none=True) if section is not None else {}

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME_RE.fullmatch(value):
            raise ValueError(f"{_show(value)} is not a valid job name. To fix: use 1-63 letters, "
                             "digits, '.', '_' or '-', starting with a letter or digit")
        return value

    @field_validator("run")
    @classmethod
    def _run(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the command is empty. To fix: write e.g. 'run: python train.py'")
        return value

    @field_validator("nproc_per_node", mode="before")
    @classmethod
    def _nproc(cls, value: Any) -> Any:
        value = whole_number_text(value)
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_PROCS_PER_NODE:
            return value
        raise ValueError(f"{_show(value)} is not a process count. To fix: write a whole number from 1 to "
                         f"{MAX_PROCS_PER_NODE}, or 'auto' (one per accelerator)")

    @field_validator("envs", mode="before")
    @classmethod
    def _envs(cls, value: Any) -> Any:
        if isinstance(value, list):
            return env_list_as_mapping(value)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{_show(value)} is not a mapping. To fix: write e.g. 'envs: {{SEED: 1}}'")
        return value or {}

    @field_validator("resources", "checkpoint", "recovery", "health", mode="before")
    @classmethod
    def _empty_section(cls, value: Any) -> Any:
        return {} if value is None else value        # `resources:` with nothing under it

    @model_validator(mode="after")
    def _resolve_paths(self, info: ValidationInfo) -> JobSpec:
        """A spec as its user wrote it (a context: a file's {"base_dir": its folder}, or ENVS_ONLY) gets its paths'
        $NAMEs filled in, and a file's paths made absolute; a stored one (no context) is kept as it is."""
        context = info.context if isinstance(info.context, dict) else None
        if context is not None:
            shell = os.environ if context.get("shell", True) else None
            self.workdir = self._expanded(("workdir",), self.workdir, shell)
            if self.checkpoint.dir is not None:
                self.checkpoint.dir = self._expanded(("checkpoint", "dir"), self.checkpoint.dir, shell)
        base = (context or {}).get("base_dir")
        if base is not None:
            self.workdir = os.path.abspath(os.path.join(base, os.path.expanduser(self.workdir)))
            if self.checkpoint.dir is not None and not checkpoint_url_scheme(self.checkpoint.dir):
                self.checkpoint.dir = os.path.abspath(
                    os.path.join(self.workdir, os.path.expanduser(self.checkpoint.dir)))
        for field, path in (("workdir", self.workdir), ("checkpoint.dir", self.checkpoint.dir)):
            if path is not None and len(path) > MAX_PATH:    # the stored spec must load again
                raise ValueError(f"{field}: {_show(path)} is longer than {MAX_PATH} characters once made "
                                 "absolute. To fix: use a shorter path")
        return self

    def _expanded(self, field: tuple[str, ...], path: str, shell: Mapping[str, str] | None) -> str:
        """`path` with each $NAME or ${NAME} replaced by the job's envs' value, else the launching `shell`'s, where
        there is one (`workdir: $HOME/code`, `dir: s3://${BUCKET}/run1`, as SkyPilot fills envs into paths); was a
        folder named '$HOME'."""
        def refused(problem: ValueError) -> ValidationError:
            return _refused(type(self).__name__, field, path, problem)

        def value(match: re.Match) -> str:
            if match[3] is not None:
                raise refused(ValueError(f"{_show(path)} has {match[0]!r}, a form tfsn does not fill in: it fills "
                                         "$NAME and ${NAME}. To fix: write it as ${NAME}, with NAME's value (a "
                                         "default) in envs"))
            name = match[1] or match[2]
            found = self.envs.get(name, shell.get(name) if shell is not None else None)
            if found is None and shell is None:
                raise refused(ValueError(f"{_show(path)} names ${name}, which is not in envs (a TfsnJob has no "
                                         f"launching shell to take it from). To fix: add {name} to envs, or write "
                                         "the path out"))
            if found is None:
                raise refused(ValueError(f"{_show(path)} names ${name}, which is neither in envs nor set in this "
                                         f"shell. To fix: add it to envs (or pass --env {name}=...), or write the "
                                         "path out"))
            return str(found)
        filled = _PATH_VARIABLE_RE.sub(value, path)
        if filled != path:      # the checks the path gets when written out (`$CKPT` empty was the workdir itself)
            try:
                _no_control(_CONTROL_RE)(filled)
                if field == ("checkpoint", "dir"):
                    CheckpointSpec._dir(filled)
            except ValueError as problem:
                raise refused(ValueError(f"{_show(path)} is {_show(filled)}: {problem}")) from None
        return filled

    def nprocs(self, accelerators: int | None = None) -> int:
        """Workers per node. "auto" means one per accelerator of the chosen offer (`accelerators`, its count;
        before an offer is chosen, the first choice's), and 1 on a node without accelerators."""
        if self.nproc_per_node != "auto":
            return self.nproc_per_node
        if accelerators is None:
            choices = self.resources.accelerator_choices()
            accelerators = choices[0].count if choices else 0
        return max(1, accelerators)


# The validation context of a spec that no shell launches (a TfsnJob): $NAME in its paths comes from its envs alone.
ENVS_ONLY = {"shell": False}


class SpecError(Exception):
    """A train.yaml is wrong; each message is one line 'FILE:LINE: FIELD: what. To fix: how'."""

    def __init__(self, messages: list[str]) -> None:
        self.messages = [" ".join(m.splitlines()) or "?" for m in messages]
        super().__init__("\n".join(self.messages))

    def __str__(self) -> str:
        return "\n".join(self.messages)


# --- loading -----------------------------------------------------------------------------------

_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_SECTIONS = ("resources", "checkpoint", "recovery", "health", "model")
_EXAMPLES = {
    "name": "tiny-gpt", "num_nodes": "2", "nproc_per_node": "auto", "workdir": ".",
    "setup": "pip install -r requirements.txt", "run": "python train.py", "steps": "300",
    "use_spot": "true", "max_hourly_cost": "30.0", "dir": "checkpoints", "keep": "3",
    "max_restarts": "3", "spares": "1", "count": "4", "at_least": "true", "local_ok": "true", "async_save": "true",
    "params": "1.3B", "layers": "24", "hidden": "2048", "seq_len": "2048", "batch_size": "256", "dtype": "bf16",
    "entry": "train.py:build", "entry_timeout": "5m",
}


# Fields of SkyPilot's and dstack's specs that tfsn spells otherwise or has not, by the section they are in: what to
# write instead. Checked before the "did you mean" guess, which sent `resources.gpus` to cpus and `accelerator_args`
# to accelerators.
_OTHER_TOOLS_FIELDS = {
    (): {
        "commands": "tfsn runs one script. To fix: write it as 'run: |' with the commands under it, one a line",
        "image": "a container image is for pods. To fix: write it under 'kubernetes:' as 'image:' (cloud VMs take "
                 "TFSN_AWS_AMI, TFSN_GCP_IMAGE or TFSN_AZURE_IMAGE)",
        "file_mounts": "tfsn mounts no files: each node gets workdir's. To fix: remove it, and read data "
                       "from object storage in the script or keep it in workdir",
        "secrets": "To fix: put them in envs, or pass them with --env NAME=VALUE",
        "type": "tfsn runs training tasks only. To fix: remove it",
        "spot_policy": "To fix: write 'use_spot: true' (or false) under resources",
    },
    ("resources",): {
        **{name: "To fix: write it as 'accelerators', e.g. 'accelerators: H100:8'" for name in ("gpu", "gpus")},
        "cloud": "To fix: write it as 'infra', e.g. 'infra: [aws]'",
        "zone": "tfsn picks the zone within the regions. To fix: write 'regions: [REGION]' instead",
        "any_of": "To fix: write the accelerators as a mapping, 'accelerators: {H100: 8, A100: 8}' (any of them: the "
                  "cheapest run wins)",
        "ordered": "To fix: write the accelerators as a list, 'accelerators: [H100:8, A100:8]' (in order of "
                   "preference)",
        **{name: "tfsn does not size disks: a node has its image's. To fix: remove it"
           for name in ("disk_size", "disk")},
        "instance_type": "tfsn picks the instance from accelerators, cpus and memory. To fix: write those instead",
        "image_id": "To fix: remove it, and set TFSN_AWS_AMI, TFSN_GCP_IMAGE or TFSN_AZURE_IMAGE (or kubernetes.image)",
        "accelerator_args": "tfsn has no accelerator arguments (nor TPUs). To fix: remove it",
    },
}


# Errors of the MAX_* bounds, which a near-miss example would not fix.
_LIMIT_FIX = {"less_than_equal": "use at most {le} (tfsn's limit)",
              "string_too_long": "shorten it to at most {max_length} characters",
              "too_long": "keep at most {max_length} entries"}


def _user_path(data: Any, loc: tuple, missing: bool) -> tuple:
    """The part of a pydantic loc the user wrote: drops union tags like 'int' or '[key]'."""
    out, cur = [], data
    for i, part in enumerate(loc):
        if isinstance(cur, dict) and part in cur:
            out.append(part)
            cur = cur[part]
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            out.append(part)
            cur = cur[part]
        elif missing and i == len(loc) - 1:
            out.append(part)
    return tuple(out)


def _dotted(path: tuple) -> str:
    text = ""
    for part in path:
        if isinstance(part, str) and not re.fullmatch(r"[A-Za-z0-9_-]+", part):
            part = repr(part)                       # '' or 'a b' or 'a.b' stay unambiguous
        elif isinstance(part, str):
            text += f".{part}" if text else part
            continue
        text += f"[{part}]"
    return text


def _line(root: yaml.Node, path: tuple) -> int:
    """1-based line of the key (or list item) at `path`, or of the deepest part that exists."""
    node, line = root, 1
    for part in path:
        found = None
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            for key, value in node.value:          # the last one wins, as after a merge ('<<')
                if isinstance(key, yaml.ScalarNode) and key.value == part:
                    found = (key.start_mark.line + 1, value)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            found = (node.value[part].start_mark.line + 1, node.value[part])
        if found is None:
            break
        line, node = found
    return line


def _model_at(path: tuple) -> type[BaseModel] | None:
    model: Any = JobSpec
    for part in path:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        model = next((t for t in (field.annotation, *get_args(field.annotation))
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if model is None:
            return None
    return model


def _key_problems(root: yaml.Node) -> list[tuple[int, str]]:
    """Duplicate and non-text keys, which safe_load would silently accept or crash on."""
    problems, seen, stack = [], set(), [(root, ())]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:                        # aliases share nodes; they may even loop
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, path + (i,)) for i, item in enumerate(node.value))
        if not isinstance(node, yaml.MappingNode):
            continue
        first: dict[str, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            if key.tag == _MERGE_TAG:
                stack.append((value, path))
            elif not isinstance(key, yaml.ScalarNode):
                problems.append((line, f"{_dotted(path) or 'key'}: a key must be text, not a "
                                       "list or mapping. To fix: use a plain name as the key"))
            elif key.tag != _STR_TAG:
                kind = key.tag.rsplit(":", 1)[-1]
                where = _dotted(path) + ": " if path else ""
                problems.append((line, f"{where}key {key.value!r} is read by YAML as {kind}, not "
                                       f"text. To fix: quote it, e.g. \"{key.value}\":"))
            elif key.value in first:
                problems.append((line, f"{_dotted(path + (key.value,))}: duplicate key (first on "
                                       f"line {first[key.value]}). To fix: keep only one"))
            else:
                first[key.value] = line
                stack.append((value, path + (key.value,)))
    return sorted(problems)


_TEXT_AS_WRITTEN = {f"tag:yaml.org,2002:{kind}" for kind in ("int", "float", "bool", "timestamp")}


def _field_nodes(node: yaml.Node, seen: set[int] | None = None) -> dict[str, yaml.Node]:
    """A mapping node's values by key, merges ('<<') included as YAML applies them: its own keys first,
    then the merged mappings' in order (aliases may loop: each mapping is read once)."""
    seen = set() if seen is None else seen
    if not isinstance(node, yaml.MappingNode) or id(node) in seen:
        return {}
    seen.add(id(node))
    found: dict[str, yaml.Node] = {}
    merged: list[yaml.Node] = []
    for key, value in node.value:
        if key.tag == _MERGE_TAG:
            merged.extend(value.value if isinstance(value, yaml.SequenceNode) else [value])
        elif isinstance(key, yaml.ScalarNode):
            found[key.value] = value
    for mapping in merged:
        for key, value in _field_nodes(mapping, seen).items():
            found.setdefault(key, value)
    return found


def _envs_as_written(data: dict, root: yaml.Node) -> None:
    """Environment values reach the workers as written: YAML would turn `VERSION: 1.10` into 1.1, `MODE: 010`
    into 8, `AT: 12:30` into 750 and `DEBUG: yes` into true, so unquoted numbers, bools and dates keep their
    text (a null stays None, refused by the model with a fix)."""
    envs = data.get("envs")
    node = _field_nodes(root).get("envs")
    if not isinstance(envs, dict) or node is None:
        return
    for key, value in _field_nodes(node).items():
        if key in envs and isinstance(value, yaml.ScalarNode) and value.style is None and value.tag in _TEXT_AS_WRITTEN:
            envs[key] = value.value


# How to fix the YAML errors users make, by words of the parser's message; the first that matches.
_YAML_FIXES = (
    ("mapping values are not allowed", "indent a field's fields under it by the same spaces, put a space after "
                                       "each key's colon (here or on the line above), and quote a value that holds "
                                       "': '"),
    ("flow", "close the brackets, as in [a, b] or {a: 1}"),
    ("expected <block end>", "indent the fields of one mapping by the same spaces"),
    ("could not find expected ':'", "write each field as 'key: value' (a space after the colon)"),
    ("single document", "keep one document: remove the '---' and what follows it (another job: its own file)"),
    ("undefined alias", "define the anchor (&NAME) before its use (*NAME), or quote a value that starts with '*'"),
    ("quoted scalar", "close the quote on that line"),
    ("constructor for the tag", "remove the tag (the '!' word): a job spec holds plain values"),
)


def _yaml_error(err: Exception, text: str) -> tuple[int, str]:
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        what = err.problem or err.context or "malformed YAML"
        if err.context and err.problem and err.context_mark is not None:
            what = f"{what} ({err.context} on line {err.context_mark.line + 1})"
        if "'\\t'" in what and mark is not None:        # an editor's tab: YAML indents and separates with spaces only
            what = (f"a tab at column {mark.column + 1}: YAML indents and separates with spaces only. To fix: "
                    "replace the tabs with spaces")
        else:
            fix = next((fix for words, fix in _YAML_FIXES if words in what), "check the YAML syntax on that line")
            what = f"{what}. To fix: {fix}"
        return (mark.line + 1 if mark else 1), f"invalid YAML: {what}"
    if isinstance(err, yaml.reader.ReaderError):
        return text[:err.position].count("\n") + 1, (
            f"invalid YAML: character U+{err.character:04X} is not allowed. To fix: remove it"
            if isinstance(err.character, int) else f"invalid YAML: {err.reason}")
    if isinstance(err, RecursionError):
        return 1, "invalid YAML: nested too deeply"
    return 1, f"invalid YAML value: {str(err).split(';')[0]}"


def _message(err: dict, data: Any, root: yaml.Node) -> tuple[tuple, int, str]:
    kind = err["type"]
    path = _user_path(data, tuple(err["loc"]), missing=kind == "missing")
    leaf = path[-1] if path else ""
    if kind == "missing":
        line = _line(root, path[:-1]) if len(path) > 1 else 1
        example = _EXAMPLES.get(leaf, "...")
        what = f"required field is missing. To fix: add '{leaf}: {example}'"
    elif kind == "extra_forbidden":
        line = _line(root, path)
        model = _model_at(path[:-1])
        fields = list(model.model_fields) if model else []
        close = close_match(str(leaf), fields)
        other_tools = _OTHER_TOOLS_FIELDS.get(path[:-1], {}).get(leaf) if isinstance(leaf, str) else None
        what = f"unknown field {leaf!r}"
        if other_tools:
            what += f". {other_tools}"
        else:
            what += (f"; did you mean {close!r}? To fix: rename it" if close
                     else f". To fix: use one of {', '.join(fields)}")
    else:
        line = _line(root, path)
        if kind == "value_error":
            what = str(err.get("ctx", {}).get("error", err["msg"]))
        elif kind == "model_type" or (kind == "dict_type" and leaf in _SECTIONS):
            what = f"expected a mapping of fields, got {_show(err.get('input'))}"
            model = _model_at(path)
            if model:
                what += f". To fix: indent fields under it, one of {', '.join(model.model_fields)}"
        elif kind == "string_type" and path in (("run",), ("setup",)) and isinstance(err.get("input"), list):
            # dstack's `commands` form; not joined, as whether a failing command stops the rest is not clear
            what = (f"a list of commands; tfsn runs one script. To fix: write it as '{leaf}: |' with the commands "
                    "under it, one a line (add 'set -e' first to stop at one that fails)")
        else:
            msg = err["msg"]
            what = f"{msg[:1].lower()}{msg[1:]}, got {_show(err.get('input'))}"
            if kind in _LIMIT_FIX:
                what += ". To fix: " + _LIMIT_FIX[kind].format(**err.get("ctx", {}))
            elif leaf in _EXAMPLES:
                what += f". To fix: write it like '{leaf}: {_EXAMPLES[leaf]}'"
            elif path[:2] == ("health", "thresholds"):
                what += (". To fix: write a number, as configs/health.yaml does (the *_s ones in seconds, or a duration "
                         "such as '2h')")
    return path, line, f"{_dotted(path)}: {what}" if path else what


def job_name_problem(name: str) -> str | None:
    """Why a new job may not take `name` though the model accepts it (a job stored with it still loads): a name of
    digits only, which `tfsn status`, `logs` and `stop` read as a job id, so that `tfsn stop 2` stopped job 2, not
    the job named 2; or None."""
    if name.isascii() and name.isdigit():
        return (f"{name!r} is digits only, which `tfsn status`, `logs` and `stop` read as a job id. "
                f"To fix: add a letter, e.g. 'job-{name}'")
    return None


def _default_name(path: str) -> str:
    stem = os.path.splitext(os.path.basename(path))[0]
    name = re.sub(r"[^A-Za-z0-9._-]", "-", stem).lstrip("._-")[:63]
    if name and job_name_problem(name):
        name = f"job-{name}"[:63]           # 2.yaml is job-2, not job id 2's namesake
    return name or "job"


def _read_text(path: str | os.PathLike, fail: Callable[[list[tuple[int, str]]], SpecError]) -> str:
    """The file's text: at most MAX_FILE_BYTES of UTF-8 (a BOM allowed)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise fail([(1, "file not found. To fix: check the path")]) from None
    except IsADirectoryError:
        raise fail([(1, "is a directory, not a file. To fix: give the path of the train.yaml")]) from None
    except (OSError, ValueError) as e:
        raise fail([(1, f"cannot read the file: {e.strerror if isinstance(e, OSError) else e}")]) from None
    if len(raw) > MAX_FILE_BYTES:
        raise fail([(1, f"file is larger than {MAX_FILE_BYTES >> 20} MiB; not a job spec")])
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise fail([(raw[:e.start].count(b"\n") + 1,
                     f"not UTF-8 text (byte {raw[e.start]:#04x}). To fix: save the file as UTF-8")]) from None


def _parse_yaml(text: str, fail: Callable[[list[tuple[int, str]]], SpecError]) -> tuple[Any, Any]:
    """The document and its YAML node tree (for line numbers); duplicate and odd keys are problems."""
    loader = None
    try:
        loader = yaml.SafeLoader(text)    # the reader rejects control characters right here
        root = loader.get_single_node()
        problems = _key_problems(root) if root is not None else []
        if problems:
            raise fail(problems)
        return (loader.construct_document(root) if root is not None else None), root
    except SpecError:
        raise
    except Exception as e:        # YAMLError, and ValueError/RecursionError from odd tags or depth
        raise fail([_yaml_error(e, text)]) from None
    finally:
        if loader is not None:
            loader.dispose()


def spec_line(path: str | os.PathLike, field: tuple[str, ...]) -> int:
    """The 1-based line of `field` in the spec file at `path` (of its deepest part written there), for a message
    about a spec that loaded; 1 where the file cannot be read again."""
    def fail(problems: list[tuple[int, str]]) -> SpecError:
        return SpecError([what for _, what in problems])
    try:
        _, root = _parse_yaml(_read_text(path, fail), fail)
    except SpecError:
        return 1
    return _line(root, field) if root is not None else 1


def _add_env_overrides(data: dict, overrides: dict[str, str], fail: Callable[[list[tuple[int, str]]], SpecError]
                       ) -> None:
    """`--env KEY=VALUE` pairs over the file's envs (a mapping, or dstack's list form, which they must not drop)."""
    for key in overrides:
        if not isinstance(key, str) or not _ENV_RE.fullmatch(key):
            raise fail([(1, f"--env {_show(key)}: not a valid environment variable name. "
                            "To fix: use letters, digits and '_', not starting with a digit")])
    envs = data.get("envs")
    if isinstance(envs, list):
        try:
            envs = env_list_as_mapping(envs)
        except ValueError:          # the model says what is wrong with it
            pass
    if envs is None or isinstance(envs, dict):
        data["envs"] = {**(envs or {}), **overrides}


# A check beyond the model that a loaded spec must pass (the CLI's: can it launch?): None, or the
# field to blame (its line is shown; () for the file as a whole) and a message that names it.
SpecCheck = Callable[[JobSpec], tuple[tuple[str, ...], str] | None]


def load_spec(path: str | os.PathLike, overrides: dict[str, str] | None = None,
              check: SpecCheck | None = None) -> JobSpec:
    """Read and validate train.yaml; `overrides` are CLI `--env KEY=VALUE` pairs over `envs`; `check`
    may refuse the valid spec.

    Raises SpecError, and only SpecError (`check` aside), with one 'FILE:LINE: FIELD: what. To fix:
    how' line per problem, whatever the file holds.
    """
    shown = os.fsdecode(os.fspath(path))

    def fail(problems: list[tuple[int, str]]) -> SpecError:
        return SpecError([f"{shown}:{line}: {what}" for line, what in problems])

    data, root = _parse_yaml(_read_text(path, fail), fail)
    if data is None:
        raise fail([(1, "the file is empty. To fix: write at least 'run: python train.py'")])
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"a single value {_show(data)}"
        raise fail([(root.start_mark.line + 1, f"the top level must be a mapping of fields, not "
                                               f"{kind}. To fix: write e.g. 'run: python train.py'")])
    data.setdefault("name", _default_name(shown))
    _envs_as_written(data, root)
    if overrides:
        _add_env_overrides(data, overrides, fail)

    base_dir = os.path.dirname(os.path.abspath(shown))
    try:
        spec = JobSpec.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as e:
        by_path: dict[tuple, tuple[int, str]] = {}
        for err in e.errors():
            p, line, what = _message(err, data, root)
            if len(p) == 2 and p[0] == "envs" and p[1] in (overrides or {}):     # the value came from the command line
                line, what = 1, f"--env {p[1]}{what.removeprefix(_dotted(p))}"
            by_path.setdefault(p, (line, what))   # one message per field, not one per union arm
        raise fail(sorted(by_path.values())) from None
    except Exception as e:        # a validator bug must still come out as a one-line SpecError
        raise fail([(1, f"cannot validate the spec: {type(e).__name__}: {e}")]) from None
    problems = []
    for key in (k for k in spec.envs if k in _TFSN_SETS):
        line, where = (1, f"--env {key}") if key in (overrides or {}) else (_line(root, ("envs", key)), f"envs.{key}")
        problems.append((line, f"{where}: tfsn sets {key} for every worker itself. To fix: {_TFSN_SETS[key]}"))
    named = job_name_problem(spec.name)
    if named:
        problems.append((_line(root, ("name",)), f"name: {named}"))
    if problems:
        raise fail(sorted(problems))
    problem = check(spec) if check is not None else None
    if problem is not None:
        field, what = problem
        raise fail([(_line(root, field), what)])
    return spec

"""The ``alert`` section: the anomaly rules (``trainmon.config.rules``), where alerts go (webhooks, rate
limits) and what happens on a NaN (``on_nan``, ``capture``, ``max_skips``), parsed and checked here once;
``trainmon.anomaly`` builds its engines and alert sinks from the typed section."""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from trainmon.config.check import ConfigError
from trainmon.config.keys import Section, key
from trainmon.config.rules import (
    RuleBase,
    default_rules,
    msprobe_rules,
    parse_rules,
    with_nan_detection,
)

__all__ = ["CAPTURE_MODES", "NAN_ACTIONS", "WEBHOOK_KINDS", "AlertConfig", "Webhook"]

NanAction = Literal["continue", "raise", "exit", "skip"]
CaptureMode = Literal["default", "exact"]
WebhookKind = Literal["generic", "slack", "dingtalk", "feishu"]
NAN_ACTIONS: tuple[str, ...] = get_args(NanAction)
CAPTURE_MODES: tuple[str, ...] = get_args(CaptureMode)
WEBHOOK_KINDS: tuple[str, ...] = get_args(WebhookKind)
_SIGNED_KINDS = ("dingtalk", "feishu")


@dataclass(frozen=True, kw_only=True)
class Webhook(Section):
    """One entry of ``alert.webhooks``. The URL and the secret may come from environment variables
    (``url_env``, ``secret_env``), so tokens need not be in config files: the variable must be set where the
    config is loaded, and is read again when the monitor builds its alert sinks."""

    url: str | None = key(None, "the webhook URL (http:// or https://)", type_doc="string")
    url_env: str | None = key(
        None, "the name of an environment variable that holds the URL", type_doc="string"
    )
    kind: WebhookKind = key("generic", "the payload's shape", what="kind")
    timeout_s: float = key(
        5.0,
        "give up on one request after this many seconds",
        lo=0.001,
        doc="Give up on one request after this many seconds: a deadline for the whole request (connect, "
        "send, reply), so a server that trickles its reply a byte at a time is cut off at `timeout_s` too.",
    )
    secret: str | None = key(None, "signing secret of dingtalk and feishu bots", type_doc="string")
    secret_env: str | None = key(
        None, "the name of an environment variable that holds the secret", type_doc="string"
    )
    given: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def _check(self, path: str | None) -> None:
        where = path or "webhook"
        url = self._value("url", where, required=True)
        scheme = urllib.parse.urlsplit(url or "").scheme
        if scheme not in ("http", "https"):
            via = "url_env" if self.url_env else "url"
            raise ConfigError(
                f"must be an http:// or https:// URL, got scheme {scheme!r}", key=f"{where}.{via}"
            )
        secret = self._value("secret", where, required=False)
        if secret and self.kind not in _SIGNED_KINDS:
            raise ConfigError(
                f"only used by kinds {', '.join(_SIGNED_KINDS)} (kind is {self.kind!r})",
                key=f"{where}.{'secret_env' if self.secret_env else 'secret'}",
            )

    def _value(self, name: str, path: str, *, required: bool) -> str | None:
        """``name``'s value, given or read from the environment variable ``<name>_env`` names."""
        given, env = getattr(self, name), getattr(self, f"{name}_env")
        if given is not None and env is not None:
            raise ConfigError(f"give {name} or {name}_env, not both", key=path)
        if env is not None:
            value = os.environ.get(env)
            if not value:
                raise ConfigError(f"environment variable {env!r} is not set", key=f"{path}.{name}_env")
            return value
        if given is None and required:
            raise ConfigError(f"required (or {name}_env)", key=f"{path}.{name}")
        return given

    def resolved(self) -> tuple[str, str | None]:
        """(URL, secret), read from the environment where the config names variables."""
        return self._value("url", "webhook", required=True), self._value("secret", "webhook", required=False)


@dataclass(frozen=True, kw_only=True)
class AlertConfig(Section):
    """``alert``: the anomaly rules (msprobe's ``rules``/``dump`` and trainmon's rule forms), where alerts go
    and what happens on a NaN. ``given`` lists the keys the config set, in its order: :meth:`to_dict` writes
    those back, so a config read, written to the manifest and read again is the same."""

    PATH = "alert"

    rules: tuple[RuleBase, ...] = key(
        (),
        "rules: nan, turbulence, zscore, max_ratio, threshold, straggler (docs/anomalies.md); nan = NaN/Inf",
        check=lambda v, p: parse_rules(v, p),
        msprobe=msprobe_rules,
        example=default_rules(),
        type_doc="list",
        default_doc="`[]` (= the `nan` and `straggler` rules)",
        doc='msprobe\'s `{"rule_name": "AnomalyNan" or "AnomalyTurbulence", "args": {"threshold": x}}` '
        'entries unchanged, and trainmon\'s `{"rule": "nan"\\|"turbulence"\\|"zscore"\\|"max_ratio"\\|'
        '"threshold", "kinds", "names", "stats", "warmup", ...}` and `{"rule": "straggler", ...}` '
        "([timing.md](timing.md#the-straggler-rule)). A list replaces the default, so keep a `nan` entry "
        "(and a `straggler` one to keep naming slow ranks); with `on_nan` other than `continue` the full "
        "`nan` rule is added when missing ([alerts.md](alerts.md#stopping-on-nan)).",
    )
    dump: bool = key(
        False,
        "dump the module where a NaN started and the flagged tensors (docs/dumps.md)",
        msprobe=True,
        doc="Dump the origin module's inputs and outputs and the flagged tensors at their next occurrence "
        "when an anomaly starts ([dumps.md](dumps.md)); msprobe's switch of the same name.",
    )
    on_nan: NanAction = key(
        "continue",
        "continue | raise | exit | skip (keep the NaN step's update from landing)",
        what="action",
        doc="On a step with NaN/Inf: go on; or keep the step's update from landing, write everything, then "
        "raise `trainmon.anomaly.alerts.TrainingNaNError` from `optimizer.step()` (parameters and optimizer "
        "state as before the NaN step: [alerts.md](alerts.md#what-the-caller-can-rely-on-raise-exit)); or "
        "the same, then exit with `exit_code`, so an orchestrator can restart the job; or `skip`: the step's "
        "NaN/Inf counters are read before the optimizer update and a poisoned update does not land (torch "
        "optimizers, DeepSpeed, Megatron), the step is recorded as a `step_skipped` anomaly and training "
        "goes on ([alerts.md](alerts.md#skipping-a-poisoned-update)). `raise`, `exit` and `skip` read the "
        "counters before each collected step's update (one small device-to-host copy); with `raise`/`exit` "
        "each step also waits for its rules to run (one writer flush per step).",
    )
    exit_code: int = key(
        3, "process exit code of on_nan: exit", hi=255, doc="Process exit code for `on_nan: exit`."
    )
    max_per_step: int = key(
        50,
        "anomaly records a step; the rest are counted in one 'suppressed' record",
        lo=1,
        doc="Anomaly records kept per step and rank; the rest become one `suppressed` line.",
    )
    saturation: bool = key(
        False,
        "also flag values at the largest finite value of their dtype",
        doc="Also treat values at the dtype's largest magnitude as overflow when locating its origin "
        "(Ascend's saturation mode).",
    )
    capture: CaptureMode = key(
        "default",
        "default | exact (check and dump the step's own tensors before the update)",
        what="mode",
        doc="When an anomaly's tensors are dumped. `default`: at a later collected step, after the writer "
        "thread noticed it (no synchronisation in a step). `exact`: at the step boundary, before the "
        "optimizer update, one small device-to-host read of the step's statistics so far; on a NaN/Inf (or a "
        "value flagged by a `threshold` or `max_ratio` rule) the origin module's inputs and outputs of that "
        "step, the tracked scalars, and the affected parameters before the update with their gradients and "
        "Adam moments are dumped at once ([dumps.md](dumps.md#exact-capture)).",
    )
    max_skips: int = key(
        10,
        "on_nan: skip skips at most this many steps, then raises",
        doc="With `on_nan: skip`: the number of skipped steps a run may have; the next NaN step raises "
        "`TrainingNaNError` instead, so a run cannot skip forever.",
    )
    webhooks: tuple[Webhook, ...] = key(
        (),
        "[{url or url_env, kind: generic|slack|dingtalk|feishu, secret(_env), timeout_s}]",
        doc="Where alerts go besides the log: a list of webhooks (keys [below](#alertwebhooks); "
        "payloads in [alerts.md](alerts.md)).",
    )
    rate_limit_s: float = key(
        300.0, "one alert line per (rule, kind, tensor) per this many seconds; 0 = no limit"
    )
    max_queue: int = key(256, "alerts waiting for delivery; more are dropped and counted", lo=1)
    max_lines: int = key(10, "lines in one alert before a '+N more alert lines' line", lo=1)
    given: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @property
    def evaluated_rules(self) -> tuple[RuleBase, ...]:
        """The rules a run evaluates: the configured ones (or the default), with NaN/Inf detection always on
        when ``on_nan`` is anything but ``continue``."""
        rules = self.rules or default_rules()
        return rules if self.on_nan == "continue" else with_nan_detection(rules)

    @property
    def delivery(self) -> tuple[Any, ...]:
        """What an alert dispatcher is built from: the webhooks and the delivery limits."""
        return (self.webhooks, self.rate_limit_s, self.max_queue, self.max_lines)

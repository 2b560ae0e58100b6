"""One flag set for every command, generated from the config dataclasses.

Every field of ``ModelConfig``/``ParallelConfig``/``TrainConfig`` that has a flag
(``fived.config.flag_of``) becomes one option, with the field's help text, type, choices and
default: ``fived train``, ``fived ledger``, ``fived plan``, ``fived grid`` and the benchmarks
all take the same options with the same defaults. The values stack as

    dataclass defaults  <  --config FILE.toml  <  flags on the command line

and ``--print-config`` prints the result as TOML (which ``--config`` reads back) and exits.
Options default to None here, so a value given on the command line can be told from one that
was not; ``configs`` does the stacking and records which keys were given (``Resolved.given``).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

from ..config import (
    V_SCHEDULES,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    check_field,
    dump_toml,
    flag_of,
    preset,
    read_toml,
)

_CLASSES = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig}
GROUPS = {
    "model": ("model", "what is trained (--model picks a preset; the TOML's [model] can "
                       "override any field of it)"),
    "layout": ("layout", "how the ranks are arranged and how each dimension runs; "
                         "world = pp·dp·ep·cp·tp"),
    "run": ("run", "the optimisation run"),
}


@dataclass(frozen=True)
class Flag:
    section: str  # model | parallel | train: where the value lives
    name: str  # the field, and the argparse dest
    flag: str  # --global-batch
    default: Any
    help: str
    choices: tuple | None
    metavar: str | None
    shown: str | None = None  # the default in words, where the value alone would mislead

    @property
    def group(self) -> str:
        if self.section == "model" or (self.section == "train" and self.name == "model"):
            return "model"
        return "layout" if self.section == "parallel" else "run"

    @property
    def kind(self) -> type:
        return type(self.default)


def table() -> list[Flag]:
    """Every flag, in the dataclasses' field order: the one list all commands build from."""
    out = []
    for section, cls in _CLASSES.items():
        for f in fields(cls):
            flag = flag_of(section, f.name)
            if not flag:
                continue
            default = f.default if f.default is not MISSING else None
            m = f.metadata
            out.append(Flag(section, f.name, flag, default, m.get("help", ""), m.get("choices"),
                            m.get("metavar"), m.get("shown")))
    # the model (--model first), then the layout, then the run
    order = {"model": 1, "layout": 2, "run": 3}
    return sorted(out, key=lambda x: 0 if x.flag == "--model" else order[x.group])


FLAGS = {f.name: f for f in table()}


def shown(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, tuple):
        return ",".join(map(str, v)) if v else "none"
    if v == "" or v is None:
        return "none"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _list_of(kind: type, flag: str):
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"give a comma list of {'integers' if kind is int else 'names'}, e.g. "
                f"{'3,5' if kind is int else 'pp,dp,ep,cp,tp'} (got {text!r})") from None
    parse.__name__ = f"{flag} list"
    return parse


def add_flag(group: Any, name: str, default: Any = MISSING, help: str | None = None,
             shown_as: str | None = None) -> None:
    """Add one shared flag to ``group`` (a parser or an argument group).

    ``default``: the command's own default where it differs from the dataclass's (a benchmark's
    --micro-batches 8; None: unset, the benchmark decides); it is what --help shows (or
    ``shown_as``) and what ``parse`` fills in."""
    f = FLAGS[name]
    if shown_as is not None:
        said = shown_as
    elif default is MISSING:
        said = f.shown or shown(f.default)
    else:
        said = shown(default)
    text = (help or f.help) + f" (default: {said})"
    kw: dict[str, Any] = {"dest": f.name, "default": None, "help": text}
    if f.kind is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif f.kind is tuple:
        kw["type"] = _list_of(int if f.name == "pp_layers" else str, f.flag)
        kw["metavar"] = f.metavar
    else:
        kw["type"] = f.kind
        if f.choices is not None:
            kw["choices"] = f.choices
            kw["metavar"] = "{" + ",".join(map(str, f.choices)) + "}"
        else:
            kw["metavar"] = f.metavar or {int: "N", float: "X", str: "NAME"}[f.kind]
    group.add_argument(f.flag, **kw)
    if default is not MISSING:
        registry = getattr(group, "_fived_defaults", None)
        if registry is None:
            registry = group._fived_defaults = {}
        registry[f.name] = default


def add_config_flags(ap: argparse.ArgumentParser, groups: tuple[str, ...] = ("model", "layout", "run"),
                     only: tuple[str, ...] | None = None, skip: tuple[str, ...] = (),
                     notes: dict[str, str] | None = None) -> None:
    """--config, --print-config and the shared flags of ``groups`` (``only``: just these);
    ``notes``: a line added to a group's description (what this command does with it)."""
    g = ap.add_argument_group("configuration", "defaults < --config FILE.toml < the flags")
    g.add_argument("--config", metavar="FILE.toml", default=None,
                   help="read [model] [parallel] [train] from this TOML file; flags override it")
    g.add_argument("--print-config", action="store_true",
                   help="print the effective configuration as TOML (readable by --config) and "
                        "exit without running anything")
    made: dict[str, Any] = {}
    names = []
    for f in table():
        if f.group not in groups or f.name in skip or (only is not None and f.name not in only):
            continue
        if f.group not in made:
            title, text = GROUPS[f.group]
            if notes and f.group in notes:
                text += f"; {notes[f.group]}"
            made[f.group] = ap.add_argument_group(title, textwrap.fill(text, 78))
        add_flag(made[f.group], f.name)
        names.append(f.name)
    ap.set_defaults(_fived_shared=tuple(names))  # what ``configs`` reads from the namespace


@dataclass(frozen=True)
class Resolved:
    """The configuration a command runs: the three configs and which keys were given."""

    model: ModelConfig
    par: ParallelConfig
    train: TrainConfig
    given: frozenset[str]  # "parallel.dp" ...: keys the TOML or a flag set

    @property
    def dp_given(self) -> bool:
        return "parallel.dp" in self.given

    def toml(self, comment: str = "") -> str:
        head = "".join(f"# {line}\n" for line in comment.splitlines())
        return head + dump_toml(self.model, self.par, self.train)


def configs(args: argparse.Namespace) -> Resolved:
    """Dataclass defaults, then ``--config``, then every flag given on the command line."""
    path = getattr(args, "config", None)
    if path:
        model, par, train, given = read_toml(path)
    else:
        model, par, train, given = ModelConfig(), ParallelConfig(), TrainConfig(), set()
    toml_model = model
    vals: dict[str, dict[str, Any]] = {"model": {}, "parallel": {}, "train": {}}
    shared = set(getattr(args, "_fived_shared", ()))
    for f in table():
        v = getattr(args, f.name, None) if f.name in shared else None
        if v is not None:
            vals[f.section][f.name] = v
            given.add(f"{f.section}.{f.name}")
    name = vals["train"].get("model")
    toml_shape = sorted(k.split(".", 1)[1] for k in given
                        if k.startswith("model.") and k not in ("model.name", "model.seq_len"))
    if name is not None and path and toml_shape and name != model.name:
        from ..config import ConfigError

        keys = [k for k in ("hidden", "layers", "heads", "ffn", "vocab") if k in toml_shape]
        keys = keys or toml_shape[:4]
        shape = ", ".join(f"{k} {getattr(model, k)}" for k in keys)
        shape += ", ..." if len(toml_shape) > len(keys) else ""
        raise ConfigError([f"--model {name} and --config {path}: the TOML's [model] section "
                           f"sets {model.name}'s shape ({shape}), which would be laid over "
                           f"{name}'s; drop --model, or write name = \"{name}\" in the TOML's "
                           "[model] (its fields then override that preset)"])
    if name is not None and name != model.name:
        # a new preset, with the TOML's own [model] overrides kept on top of it
        model = preset(name)
        keep = {k.split(".", 1)[1] for k in given
                if k.startswith("model.") and k != "model.name"}
        model = replace(model, **{k: getattr(toml_model, k) for k in keep})
        given.add("model.name")
    model = replace(model, **vals["model"])
    par = replace(par, **vals["parallel"])
    if "parallel.schedule" not in given and par.virtual_stages > 1:
        par = replace(par, schedule="interleaved")
    if par.schedule in V_SCHEDULES and "parallel.virtual_stages" not in given:
        par = replace(par, virtual_stages=2)
    train = replace(train, **{**vals["train"], "model": model.name})
    return Resolved(model, par, train, frozenset(given))


def print_config(res: Resolved, comment: str = "") -> int:
    sys.stdout.write(res.toml(comment))
    sys.stdout.flush()
    return 0


# ------------------------------------------------------------------ the benchmarks
def parse(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse a benchmark's command line: its shared flags (``add_flag`` with its defaults) get
    the value from the command line, else ``--config``, else the benchmark's default; each is
    checked against the field's bounds (a bad one exits 2 naming the flag, as argparse does).
    ``--print-config`` prints those values as TOML and exits 0."""
    ap.add_argument("--config", metavar="FILE.toml", default=None,
                    help="read the shared settings from this TOML file; flags override it")
    ap.add_argument("--print-config", action="store_true",
                    help="print the settings as TOML and exit without running anything")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    registry: dict[str, Any] = {}
    for g in [ap, *ap._action_groups]:
        registry.update(getattr(g, "_fived_defaults", {}))
    from_toml: dict[str, Any] = {}
    if args.config:
        from ..config import ConfigError

        try:
            model, par, train, given = read_toml(args.config)
        except ConfigError as e:
            ap.error("; ".join(e.problems))
        objs = {"model": model, "parallel": par, "train": train}
        for name in registry:
            f = FLAGS[name]
            if f"{f.section}.{name}" in given:
                from_toml[name] = getattr(objs[f.section], name)
    problems = []
    for name, default in registry.items():
        if getattr(args, name) is None:
            setattr(args, name, from_toml.get(name, default))
        if getattr(args, name) is None:
            continue  # unset: the benchmark's own default
        p = check_field(FLAGS[name].section, name, getattr(args, name))
        if p:
            problems.append(p)
    if problems:
        ap.error("; ".join(problems))
    if args.print_config:
        out: dict[str, list[str]] = {}
        from ..config import _toml_value

        for name in registry:
            f = FLAGS[name]
            if getattr(args, name) is None:
                continue
            out.setdefault(f.section, []).append(f"{name} = {_toml_value(getattr(args, name))}")
        for section in ("model", "parallel", "train"):
            if section in out:
                print(f"[{section}]\n" + "\n".join(out[section]) + "\n")
        raise SystemExit(0)
    return args

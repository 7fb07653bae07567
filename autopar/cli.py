"""The `autopar` command line: plan, compare, explain, diff, report and demo.

Bad arguments and user errors print one line on stderr and exit with status 2; set AUTOPAR_DEBUG=1 to see the
traceback of an unexpected failure.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import subprocess
import sys
import warnings
from typing import Any, Sequence

DEFAULT_AXES = {1: ("dp",), 2: ("dp", "tp")}


class CliError(ValueError):
    """A bad command-line argument; the message says what to change."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise CliError(f"{self.prog}: {message} (see {self.prog} --help)")


# --- models -------------------------------------------------------------------------------------------------

def model_spec(args: argparse.Namespace):
    """The ModelSpec the arguments name (recorded in the plan, so the file alone can rebuild the model)."""
    from autopar.model_spec import ModelSpec

    return ModelSpec.named(args.model, batch=args.batch or 8, seq=args.seq, inputs=args.inputs, loss=args.loss)


def known_models() -> list[str]:
    from autopar.model_spec import known_models as names

    return names()


# --- mesh and config ------------------------------------------------------------------------------------------

def parse_mesh(args: argparse.Namespace, base: Any = None):
    """(shape, axis names, links dict, device) from --mesh/--axes/--links/--device, defaulting to a loaded plan's."""
    from autopar.cost.hardware import HARDWARE
    from autopar.mesh import LINK_KINDS

    default = base.mesh if base is not None else None

    if args.mesh:
        try:
            shape = tuple(int(x) for x in args.mesh.lower().replace("*", "x").split("x"))
        except ValueError:
            raise CliError(f"--mesh {args.mesh!r} must look like 8 or 8x8") from None
        if any(n < 1 for n in shape):
            raise CliError(f"--mesh {args.mesh!r}: every axis needs at least one rank")
    elif default is not None:
        shape = tuple(default.shape)
    else:
        raise CliError("give the mesh shape with --mesh, e.g. --mesh 8x8 --axes dp,tp")
    if args.axes:
        axes = tuple(a.strip() for a in args.axes.split(","))
    elif default is not None and len(default.axis_names) == len(shape):
        axes = tuple(default.axis_names)
    elif len(shape) in DEFAULT_AXES:
        axes = DEFAULT_AXES[len(shape)]
    else:
        raise CliError(f"name the {len(shape)} mesh axes with --axes, e.g. --axes dp,cp,tp")
    if len(axes) != len(shape) or len(set(axes)) != len(axes) or not all(axes):
        raise CliError(f"--mesh {'x'.join(map(str, shape))} has {len(shape)} axes but --axes names "
                       f"{len(axes)}: {','.join(axes)}" if len(axes) != len(shape) else
                       f"--axes {','.join(axes)}: axis names must be distinct and non-empty")
    device = (args.device or (base.device if base is not None else None) or "h100").lower()
    if device not in HARDWARE:
        raise CliError(f"unknown device {device!r}; known devices: {', '.join(sorted(HARDWARE))}")
    links = None
    if args.links:
        kinds = [k.strip() for k in args.links.split(",")]
        if len(kinds) != len(axes):
            raise CliError(f"--links gives {len(kinds)} link kinds for {len(axes)} axes ({','.join(axes)})")
        for k in kinds:
            if k not in LINK_KINDS:
                raise CliError(f"unknown link kind {k!r}; known: {', '.join(LINK_KINDS)}")
        links = dict(zip(axes, kinds))
    elif default is not None and tuple(default.axis_names) == axes:
        links = dict(zip(axes, default.links))
    return shape, axes, links, device


def make_config(args: argparse.Namespace, links: dict | None, device: str):
    from autopar.config import Config

    if args.memory_gb is not None and args.memory_gb <= 0:
        raise CliError(f"--memory-gb must be positive, got {args.memory_gb}")
    if args.time_limit is not None and args.time_limit <= 0:
        raise CliError(f"--time-limit must be positive, got {args.time_limit}")
    limit = {} if args.time_limit is None else {"solver_time_limit_s": args.time_limit}
    config = Config(device=device, links=links, memory_limit_gb=args.memory_gb,
                    mixed_precision=getattr(args, "precision", None), **limit)
    return config.with_(fp8=args.fp8) if getattr(args, "fp8", None) else config


def _setup(args: argparse.Namespace, base: Any = None):
    """(ModelSpec, BuiltModel, fake mesh, Config) from the arguments, defaulting to a loaded plan's mesh,
    device, config and model."""
    from autopar.config import Config
    from autopar.mesh import fake_mesh

    if args.batch is not None and args.batch < 1:
        raise CliError(f"--batch must be at least 1, got {args.batch}")
    shape, axes, links, device = parse_mesh(args, base)
    config = make_config(args, links, device)
    if base is not None and base.config:
        # The plan's own config (pins, memory limit, precision, ...), with what the command line overrides.
        recorded = Config.from_json(base.config)
        config = recorded.with_(**{k: getattr(config, k) for k in ("device", "links", "memory_limit_gb",
                                                                    "solver_time_limit_s", "mixed_precision")
                                   if getattr(config, k) is not None})
        if getattr(args, "fp8", None):
            config = config.with_(fp8=args.fp8)
    if args.model:
        spec = model_spec(args)
    elif base is not None and base.model_spec is not None:
        spec = base.model_spec
        changes = {k: getattr(args, k) for k in ("batch", "seq") if getattr(args, k) is not None}
        spec = dataclasses.replace(spec, **changes) if changes and spec.rebuildable else spec
    else:
        raise CliError("name the model (a built-in name or path/to/model.py:build_model)")
    built = spec.build()
    mesh = fake_mesh(shape, axes, device_type="cpu" if device == "cpu" else "cuda")
    return spec, built, mesh, config


# --- commands -----------------------------------------------------------------------------------------------

def _width() -> int:
    import shutil

    return max(80, shutil.get_terminal_size((110, 24)).columns) if sys.stdout.isatty() else 110


def cmd_plan(args: argparse.Namespace) -> int:
    import autopar
    from autopar.inspect import format_plan

    spec, built, mesh, config = _setup(args)
    if args.recipe:
        from autopar.recipes import plan_recipe, recipe

        recipe(args.recipe)  # an unknown name fails here, before any planning
        plan = plan_recipe(args.recipe, built.model, mesh, built.inputs, loss_fn=built.loss_fn, config=config,
                           example_kwargs=built.kwargs)
        if plan.solver_stats.get("recipe_note"):
            print(f"autopar: warning: {args.recipe}: {plan.solver_stats['recipe_note']}", file=sys.stderr)
    else:
        plan = autopar.plan(built.model, mesh, built.inputs, example_kwargs=built.kwargs, loss_fn=built.loss_fn,
                            config=config)
    plan.model = spec.to_json()
    print(plan.summary() if args.summary else format_plan(plan, width=_width(), color=sys.stdout.isatty()))
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    if args.report:
        from autopar.inspect import write_report

        write_report(plan, args.report)
        print(f"wrote {args.report}", file=sys.stderr)
    return 0


def _target(args: argparse.Namespace):
    """The plan file named by args.target (None when it names a model, which then becomes args.model)."""
    if args.target.endswith(".json"):
        return load_plan(args.target)
    if args.model and args.model != args.target:
        raise CliError("give the model once: either as the first argument or with --model")
    args.model = args.target
    return None


def cmd_compare(args: argparse.Namespace) -> int:
    from autopar.progress import Progress
    from autopar.recipes import RECIPES, compare

    names = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in names if r not in RECIPES]
    if unknown:
        raise CliError(f"unknown recipe {unknown[0]!r}; known: {', '.join(RECIPES)}")
    base = _target(args)
    spec, built, mesh, config = _setup(args, base)
    with Progress(what="comparing") as prog:
        say = prog.update if prog.enabled else None
        result = compare(built.model, mesh, built.inputs, loss_fn=built.loss_fn, config=config, recipes=names,
                         plan=base, example_kwargs=built.kwargs, progress=say)
    for r in result.rows[1:]:
        if base is not None and r.plan is not None and r.plan.fingerprint != base.fingerprint:
            print(f"autopar: warning: {args.target} was planned for a different model, inputs or mesh than "
                  f"{spec.describe()}; pass the arguments used to make it", file=sys.stderr)
            break
    print(result.table(width=_width()))
    if args.save_dir:
        os.makedirs(args.save_dir, exist_ok=True)
        for name, p in result.plans.items():
            p.model = spec.to_json()
            p.save(os.path.join(args.save_dir, f"{name.replace('+', '_')}.json"))
        print(f"wrote {len(result.plans)} plans to {args.save_dir}", file=sys.stderr)
    return 0


def cmd_program(args: argparse.Namespace) -> int:
    import autopar
    from autopar.inspect import format_program

    base = load_plan(args.plan)
    n = 1
    for s in base.mesh.shape:
        n *= s
    if not 0 <= args.rank < n:
        raise CliError(f"--rank {args.rank} is outside the plan's mesh of {n} ranks")
    spec = base.model_spec
    if spec is None or not spec.rebuildable:
        what = spec.describe() if spec is not None else "an unrecorded model"
        raise CliError(f"{args.plan} was made in Python from {what}, which the command line cannot rebuild; "
                       "call autopar.program(plan, rank, model=..., example_inputs=...) in Python, or plan from "
                       "the command line with path/to/model.py:build_model")
    prog = autopar.program(base, args.rank)
    print(format_program(prog, width=_width(), code=not args.no_code,
                         max_collectives=None if args.all else 80), end="")
    return 0


def load_plan(path: str):
    from autopar.plan import Plan

    if not os.path.isfile(path):
        raise CliError(f"plan file {path!r} does not exist")
    return Plan.load(path)


def cmd_explain(args: argparse.Namespace) -> int:
    from autopar.inspect import explain

    print(explain(load_plan(args.plan), args.name, width=_width()), end="")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from autopar.inspect import diff

    a, b = load_plan(args.a), load_plan(args.b)
    print(diff(a, b, width=_width(), labels=(os.path.basename(args.a), os.path.basename(args.b))), end="")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from autopar.inspect import write_report

    figs = write_report(load_plan(args.plan), args.output, png_dir=args.png)
    print(f"wrote {args.output} ({len(figs)} plots)" + (f" and PNGs in {args.png}" if args.png else ""),
          file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("autopar.demo") is None:
        raise CliError("autopar.demo is not part of this installation")
    return subprocess.call([sys.executable, "-m", "autopar.demo", *args.rest])


# --- parser -------------------------------------------------------------------------------------------------

def _model_args(p: argparse.ArgumentParser, *, model_option: bool = False) -> None:
    if model_option:
        p.add_argument("--model", help="model of the plan file, when it records none (plans made in Python): a "
                                       "built-in name or path/to/model.py:build_model")
    p.add_argument("--mesh", help="mesh shape, e.g. 8x8 (default for compare: the plan file's)")
    p.add_argument("--axes", help="mesh axis names, e.g. dp,tp (default: dp / dp,tp)")
    p.add_argument("--links", help="link kind per axis: nvlink, ib, pcie or loopback, e.g. ib,nvlink")
    p.add_argument("--device", help="target device: h100, h200, a100 or cpu (default h100)")
    p.add_argument("--batch", type=int, help="global batch size (default 8, or the plan file's)")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's maximum)")
    p.add_argument("--inputs", help="path/to/model.py:example_inputs, a function returning a tuple of inputs")
    p.add_argument("--loss", help="path/to/file.py:loss_fn(output, *inputs) -> scalar loss")
    p.add_argument("--memory-gb", type=float, help="per-rank memory limit in GB (default: the device's)")
    p.add_argument("--time-limit", type=float, help="planning time limit in seconds (default 300)")
    p.add_argument("--precision", choices=("bf16", "fp32"),
                   help="compute precision: bf16 (autocast, fp32 master weights) or fp32 (default: bf16 on GPU "
                        "devices, fp32 on cpu)")
    p.add_argument("--fp8", choices=("off", "auto", "all"),
                   help="FP8 matmuls: off (default), auto (chosen per matmul by cost) or all (every eligible one)")


def build_parser() -> argparse.ArgumentParser:
    models = ", ".join(known_models())
    parser = _Parser(prog="autopar", description="Plan, compare and inspect automatic parallelization of a "
                                                 "PyTorch model over a device mesh.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    p = sub.add_parser("plan", help="plan a model on a mesh", description=f"Plan a model. Built-in models: {models}; "
                       "or path/to/model.py:build_model with --inputs path/to/model.py:example_inputs.")
    p.add_argument("model", help="built-in model name or path/to/model.py:build_model")
    _model_args(p)
    p.add_argument("--recipe", help="plan with a hand-written recipe's pins (ddp, fsdp, megatron, fsdp+tp, ...)")
    p.add_argument("-o", "--output", help="write the plan as JSON")
    p.add_argument("--report", help="also write an HTML report (with the simulated step timeline)")
    p.add_argument("--summary", action="store_true", help="print the short summary instead of the full table")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("compare", help="compare the solver's plan with hand-written recipes",
                       description="Compare the solver's plan with DDP, FSDP, Megatron TP, ... under the same cost "
                                   "model. TARGET is a model (as for `plan`) or a plan .json file, whose recorded model, "
                                   "mesh and config are used unless overridden.")
    p.add_argument("target", help="model name, path/to/model.py:build_model, or a plan .json file (its model, mesh "
                                  "and config are read from the file)")
    _model_args(p, model_option=True)
    p.add_argument("--recipes", default="ddp,fsdp,megatron,fsdp+tp", help="comma-separated recipe names")
    p.add_argument("--save-dir", help="write every plan of the comparison as JSON into this folder")
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("program", help="print the program one rank runs under a plan",
                       description="Generate and print the per-rank program of a plan file: what the rank holds, "
                                   "its collectives in issue order with their process groups and buckets, and "
                                   "its forward and backward code. The model is rebuilt from the plan file and "
                                   "captured whole on a fake mesh: nothing is launched.")
    p.add_argument("plan", help="plan .json file (made by `autopar plan ... -o`)")
    p.add_argument("--rank", type=int, default=0, help="global rank (default 0)")
    p.add_argument("--all", action="store_true", help="list every collective (default: the first 80)")
    p.add_argument("--no-code", action="store_true", help="leave out the generated code")
    p.set_defaults(func=cmd_program)
    p = sub.add_parser("explain", help="why a parameter or op got its layout", description="Explain a plan entry: "
                       "its layout, cost and alternatives.")
    p.add_argument("plan", help="plan .json file")
    p.add_argument("name", help="parameter FQN (layers.0.attention.wq.weight) or node key")
    p.set_defaults(func=cmd_explain)
    p = sub.add_parser("diff", help="compare two plan files", description="Show what differs between two plans.")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(func=cmd_diff)
    p = sub.add_parser("report", help="write an HTML report of a plan", description="Write a self-contained HTML "
                       "report with plots of a plan.")
    p.add_argument("plan", help="plan .json file")
    p.add_argument("-o", "--output", default="report.html", help="HTML file to write (default report.html)")
    p.add_argument("--png", help="also write each plot as PNG into this folder")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("demo", help="run the autopar demo (python -m autopar.demo)",
                       description="Run python -m autopar.demo, passing any further arguments through.")
    p.add_argument("rest", nargs="*", help="arguments passed on to the demo")
    p.set_defaults(func=cmd_demo)
    return parser


def _one_line(e: BaseException) -> str:
    return " ".join(line.strip() for line in str(e).strip().splitlines() if line.strip()) or type(e).__name__


def _warn(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"autopar: warning: {_one_line(Exception(str(message)))}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    from autopar.errors import AutoparError

    old = warnings.showwarning
    warnings.showwarning = _warn
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        if argv[:1] == ["demo"] and argv[1:2] not in (["-h"], ["--help"]):
            return cmd_demo(argparse.Namespace(rest=argv[1:]))  # everything after `demo` belongs to the demo
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except SystemExit as e:  # --help
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    except (CliError, AutoparError, ValueError, OSError) as e:
        print(f"autopar: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # an unexpected failure: one line unless debugging
        if os.environ.get("AUTOPAR_DEBUG"):
            raise
        print(f"autopar: internal error: {type(e).__name__}: {_one_line(e)} (set AUTOPAR_DEBUG=1 for the "
              "traceback)", file=sys.stderr)
        return 1
    finally:
        warnings.showwarning = old


if __name__ == "__main__":
    sys.exit(main())

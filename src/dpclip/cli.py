"""Command line: ``dpclip train | run | compare | report | epsilon | strategies | datasets |
models | bench | search | schedules | search-report``.

With ``--json`` the last line of stdout is one JSON object (progress goes to stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Sequence

from dpclip.accounting import compute_epsilon
from dpclip.audit.blackbox import blackbox_audit
from dpclip.audit.step_audit import audit_step
from dpclip.bench import run_bench
from dpclip.clipping import list_strategies, make_strategy
from dpclip.data import DATASETS, independent_public_split, list_datasets, load_dataset
from dpclip.errors import DpclipWarning, unknown_name
from dpclip.events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent
from dpclip.federated.command import add_arguments as _fl_arguments, run_command
from dpclip.harness.evidence import append_row
from dpclip.harness.report import build_report
from dpclip.harness.reproduce import regenerate
from dpclip.harness.runner import run_experiment
from dpclip.harness.spec import SpecError, load_spec
from dpclip.interrupts import TrainingInterrupted
from dpclip.models import MODELS, list_models
from dpclip.runtime import maybe_reexec_with_jemalloc
from dpclip.search import (
    GreedyConfig,
    check_public,
    default_schedule_name,
    resolve_strategy_params,
    run_or_reuse,
    search_noise_multiplier,
)
from dpclip.store import ResultsStore, default_db_path
from dpclip.training.checkpoint import private_root
from dpclip.training.plan import CLI_FLAGS, Plan, resolve_noise
from dpclip.training.sampling import make_sampler
from dpclip.training.trainer import TrainConfig, train
from dpclip.training.units import MiniSetSampler, UnitConfig, expected_units, resolve_unit

__all__ = ["main"]


def _parse_params(items: Sequence[str] | None, flag: str = "--param") -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or ():
        if "=" not in item:
            raise SystemExit(f"error: {flag} expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _options(registry: Any, name: str, items: Sequence[str] | None, flag: str) -> dict[str, Any]:
    """``--model-option`` / ``--dataset-option`` values converted to the types the registered
    builder or loader declares (``dpclip.registry.coerce``); for an unknown ``name`` the strings
    are kept and the config refuses the name itself (with "did you mean")."""
    raw = _parse_params(items, flag)
    entry = registry.get(name)
    return entry.coerce_options(raw) if entry is not None else raw


def _emit(obj: dict[str, Any], as_json: bool, text: str) -> None:
    if as_json:
        print(json.dumps(obj, default=str))
    else:
        print(text)


def _add_unit_arguments(parser: argparse.ArgumentParser) -> None:
    """``--unit`` and ``--miniset-size``: the clipping unit, beside ``--strategy``."""
    parser.add_argument("--unit", default="ic", choices=["ic", "bc", "gbc"],
                        help="clipping unit: ic (per example, default), bc (batch clipping), "
                             "gbc (mini-sets of --miniset-size examples; --sampling fixed-size); "
                             "see docs/strategies.md, 'Clipping units'")
    parser.add_argument("--miniset-size", type=int, metavar="S",
                        help="--unit gbc: examples per mini-set (the batch size a multiple of S)")


def cmd_train(args: argparse.Namespace) -> int:
    _check_dataset_name(args.dataset)
    _check_data_dir(args)
    config = TrainConfig(
        dataset=args.dataset,
        model=args.model,
        strategy=args.strategy,
        strategy_params=_parse_params(args.param),
        unit=args.unit, miniset_size=args.miniset_size, bn_stats=args.bn_stats,
        public_fraction=args.public_fraction,
        model_options=_options(MODELS, args.model, args.model_option, "--model-option"),
        dataset_options=_options(DATASETS, args.dataset, args.dataset_option, "--dataset-option"),
        epsilon=args.epsilon,
        noise_multiplier=args.noise_multiplier,
        delta=args.delta,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        lr_gamma=args.lr_gamma,
        lr_step_epochs=args.lr_step_epochs,
        lr_min=args.lr_min,
        lr_warmup_epochs=args.lr_warmup_epochs,
        augment=args.augment,
        augment_multiplicity=args.augment_multiplicity,
        averaging=args.averaging,
        optimizer=args.optimizer,
        momentum=args.momentum,
        seed=args.seed,
        reproducible_noise=args.reproducible_noise,
        sampling=args.sampling,
        accountant=args.accountant,
        engine=args.engine,
        max_physical_batch=args.max_physical_batch,
        data_dir=args.data_dir,
        device=args.device,
        eval_every=args.eval_every,
    )
    config = _resolve_train_config(config, args.db or default_db_path(), args.checkpoint_dir,
                                   not args.no_progress)
    # without --checkpoint-dir the run still checkpoints (under the private directory beside $DPCLIP_OUT, removed
    # when it finishes), so that Ctrl-C and the same command again lose nothing
    ck_dir = args.checkpoint_dir or _default_checkpoint_dir(config)
    if int(os.environ.get("RANK", "0") or 0) != 0:  # torchrun: rank 0 stores and prints
        train(config, checkpoint_dir=ck_dir, progress=False)
        return 0
    store = ResultsStore(args.db or default_db_path())
    run_ids: list[int] = []  # the row is made once every input is checked: a refusal leaves none

    def start() -> None:
        run_ids.append(store.start_run(config.fingerprint(), config.to_dict()))

    try:
        result = train(
            config,
            checkpoint_dir=ck_dir,
            progress=not args.no_progress,
            on_epoch=lambda row: store.log_epoch(run_ids[0], row["epoch"], row),
            on_start=start,
        )
    except TrainingInterrupted as exc:  # main() prints how to resume
        if run_ids:
            store.interrupt_run(run_ids[0], exc.message("run the same command"))
        store.close()
        raise
    except BaseException as exc:
        if run_ids:
            store.fail_run(run_ids[0],
                           "".join(traceback.format_exception_only(type(exc), exc)).strip())
        store.close()
        raise
    run_id = run_ids[0]
    if args.checkpoint_dir is None:  # the default checkpoint of a finished run is not needed
        import shutil

        shutil.rmtree(ck_dir, ignore_errors=True)
    summary = dict(result.summary, run_id=run_id, db=str(store.path))
    if summary.get("randomness_warning"):
        print(f"warning: {summary['randomness_warning']} (--reproducible-noise)", file=sys.stderr)
    store.finish_run(run_id, result.summary, result.ledger.to_dict())
    store.close()
    if args.evidence:
        _append_evidence(args.evidence, summary, args.train_argv)
    if not args.json:
        for row in result.history:
            print(f"epoch {row['epoch']:>5.4g}  test_acc {row['test_accuracy']:.4f}  "
                  f"eps {row['epsilon']:.4g}")
    _emit(
        summary,
        args.json,
        f"{summary['strategy']} on {summary['dataset']}/{summary['model']}: test accuracy "
        f"{summary['test_accuracy']:.4f} at epsilon {summary['epsilon']:.4g} "
        f"(delta {summary['delta']:g}, {summary['accountant']}, {summary['adjacency']}), "
        f"noise multiplier {summary['noise_multiplier']:.4f}, {summary['steps']} steps, "
        f"{summary['wall_seconds']:.1f} s; stored as run {run_id} in {summary['db']}",
    )
    return 0


def _append_evidence(path: str, summary: dict[str, Any], train_argv: list[str]) -> None:
    """``dpclip train ... --evidence FILE``: the run's summary row appended to the committed
    evidence file and its Markdown table rewritten (``dpclip.harness.evidence``)."""
    argv = [a for a in train_argv if a != "--evidence" and a != path
            and not a.startswith("--evidence=")]
    row = json.loads(json.dumps(summary, default=str))
    row["command"] = "dpclip " + " ".join(argv)
    if "--noise-multiplier" in argv:
        row["noise_multiplier_arg"] = float(argv[argv.index("--noise-multiplier") + 1])
    append_row(Path(path), row)


def _default_checkpoint_dir(config: Any) -> str:
    """Where ``dpclip train`` checkpoints without ``--checkpoint-dir``: one directory per config
    fingerprint under the private directory beside ``$DPCLIP_OUT`` (``./runs-private/checkpoints``,
    or ``$DPCLIP_PRIVATE``; the same place ``dpclip run`` uses, never inside the published
    reports)."""
    return os.path.join(private_root(_default_out()), "checkpoints", config.fingerprint())


def cmd_epsilon(args: argparse.Namespace) -> int:
    if not (0 < args.sample_rate <= 1):
        raise SystemExit(f"error: --sample-rate must be in (0, 1], got {args.sample_rate}")
    if args.steps < 0:
        raise SystemExit(f"error: --steps must be >= 0, got {args.steps}")
    event = SelfComposedEvent(
        PoissonSampledEvent(args.sample_rate, GaussianEvent(args.noise_multiplier)), args.steps
    )
    rep = compute_epsilon(event, args.delta, accountant=args.accountant)
    obj = {
        "epsilon": rep.epsilon,
        "delta": args.delta,
        "accountant": rep.accountant,
        "adjacency": "add-remove-one",
        "sampling": "poisson",
        "sample_rate": args.sample_rate,
        "noise_multiplier": args.noise_multiplier,
        "steps": args.steps,
    }
    _emit(obj, args.json, f"epsilon = {rep.epsilon:.4f} at delta = {args.delta:g} "
          f"({rep.accountant}, Poisson sampling q={args.sample_rate:g}, "
          f"noise multiplier {args.noise_multiplier:g}, {args.steps} steps)")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]]
    if args.command == "strategies":
        rows = [{"name": e.name, "kind": e.kind, "paper": e.paper, "summary": e.summary,
                 "parameters": e.parameters()} for e in list_strategies()]
    elif args.command == "datasets":
        rows = [_entry_dict(e) for e in list_datasets()]
    else:
        rows = [_entry_dict(e) for e in list_models()]
    if args.json:
        print(json.dumps({args.command: rows}, default=str))
    else:
        for r in rows:
            desc = r.get("summary") or r.get("description") or ""
            print(f"{r['name']:<18} {desc}")
    return 0


def _entry_dict(e: Any) -> dict[str, Any]:
    import dataclasses

    if dataclasses.is_dataclass(e):
        return {f.name: getattr(e, f.name) for f in dataclasses.fields(e)
                if not callable(getattr(e, f.name))}
    return {"name": str(e)}


def cmd_bench(args: argparse.Namespace) -> int:
    rows = run_bench(args.model, args.batch_size, methods=args.method, steps=args.steps,
                     warmup=args.warmup, device=args.device)
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            ratio = r["extra_mem_ratio_to_nonprivate"]
            print(f"{r['model']:<14} B={r['batch_size']:<5} {r['method']:<14} "
                  f"{r['allocator']:<8} {r['ms_per_step']:9.2f} ms  x{r['ratio_to_nonprivate']:.2f}"
                  f"  peak {r['peak_mem_mb']:.0f} MB, step +{r['extra_mem_mb']:.1f} MB"
                  + (f" (x{ratio:.2f})" if ratio is not None else ""))
    if args.plot:
        # the two plotting modules import matplotlib (an optional extra): deferred to their commands
        from dpclip.bench_plot import bench_report

        page, png = bench_report(rows, args.plot)
        print(f"plot: {page} (and {png})", file=sys.stderr if args.json else sys.stdout)
    return 0


def _default_out() -> str:
    import os

    return os.environ.get("DPCLIP_OUT", "runs")


def cmd_run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.set or ())
    db = args.db or default_db_path()
    out = args.out or _default_out()
    rep = run_experiment(spec, db=db, out_dir=out, workers=args.workers,
                         progress=not args.no_progress)
    if int(os.environ.get("RANK", "0") or 0) != 0:  # torchrun: rank 0 reports
        return 1 if rep.failed else 0
    print(f"{spec.name}: {rep.total} runs, {rep.skipped} already finished, "
          f"{len(rep.finished)} finished now, {len(rep.failed)} failed", file=sys.stderr)
    for label, err in rep.failed:
        print(f"  FAILED {label}: {err}", file=sys.stderr)
    result: dict[str, Any] = {"experiment": spec.name, "total": rep.total,
                              "skipped": rep.skipped, "finished": len(rep.finished),
                              "failed": [lab for lab, _ in rep.failed], "db": str(db)}
    if args.report:
        with ResultsStore(db) as store:
            r = build_report(store, spec.name, out)
        result.update(markdown=str(r.markdown_path), html=str(r.html_path))
        if not args.json:  # the tables are in the files; stdout says where
            print(f"report: {r.html_path} (and {r.markdown_path}, {len(r.plots)} plots)")
    if args.json:
        print(json.dumps(result))
    return 1 if rep.failed else 0


def cmd_report(args: argparse.Namespace) -> int:
    try:
        name = load_spec(args.experiment).name
    except SpecError:
        name = args.experiment
    with ResultsStore(args.db or default_db_path()) as store:
        r = build_report(store, name, args.out or _default_out())
    if args.json:
        print(json.dumps({"experiment": name, "markdown": str(r.markdown_path),
                          "html": str(r.html_path), "plots": [str(p) for p in r.plots]}))
    else:
        print(f"report: {r.html_path} (and {r.markdown_path}, {len(r.plots)} plots)")
    return 0


def cmd_reproductions(args: argparse.Namespace) -> int:
    counts = regenerate(args.db or default_db_path(), args.dir, args.doc)
    for name, n in counts.items():
        print(f"{name}: {n} finished runs")
    print(f"wrote {args.doc}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """``dpclip audit``: white-box audit of the configured step (dpclip.audit.step_audit) or
    black-box audit of a training run (dpclip.audit.blackbox); stored in the results store under
    experiment "audit". Exit status 1 when a lower bound exceeds the claim."""
    unit, strategy_params = resolve_unit(
        {"unit": args.unit, "miniset_size": args.miniset_size}, _parse_params(args.param),
        where="dpclip audit", front="--unit")
    record: dict[str, Any] = {"mode": args.mode, "strategy": args.strategy,
                              "params": strategy_params, "unit": unit.unit,
                              "sampling": args.sampling, "engine": args.engine,
                              "noise_multiplier": args.noise_multiplier, "delta": args.delta,
                              "significance": args.significance, "canaries": args.canaries,
                              "seed": args.seed}
    if args.mode == "whitebox":
        if args.claim is not None:
            raise ValueError("dpclip audit: --claim is for --mode blackbox (a white-box audit's "
                             "claim is the audited step's own epsilon); drop it")
        z = args.noise_multiplier
        if z is not None and args.epsilon is not None:
            raise ValueError(
                "dpclip audit --mode whitebox: --epsilon is not used with --noise-multiplier (the "
                "claim audited is the step's own epsilon at that multiplier, not yours); drop "
                "--epsilon, or drop --noise-multiplier to audit the multiplier dpclip train "
                "calibrates for --epsilon (with --dataset, --epochs and --batch-size)")
        if z is None:
            if args.epsilon is None or not args.dataset:
                raise ValueError("dpclip audit --mode whitebox needs --noise-multiplier (the "
                                 "step's multiplier; the claim is one step's epsilon), or "
                                 "--epsilon with --dataset, --epochs and --batch-size (the "
                                 "multiplier dpclip train would calibrate for that run)")
            z = _whitebox_calibrated_z(args, unit, strategy_params)
            record["noise_multiplier"] = z
            record["noise_multiplier_source"] = (
                f"calibrated as dpclip train does: epsilon {args.epsilon:g} over {args.epochs} "
                f"epochs of {args.dataset}, batch size {args.batch_size:g}, {args.sampling}")
        r = audit_step(make_strategy(args.strategy, strategy_params),
                       noise_multiplier=z, delta=args.delta,
                       engine=args.engine, unit=unit.unit, sampling=args.sampling,
                       n_canaries=args.canaries, significance=args.significance,
                       miniset_size=unit.miniset_size or 2, seed=args.seed,
                       progress=not args.no_progress, params=strategy_params)
        summary = {**record, **r.to_dict(), "claim_scope": "one step, no sampling amplification"}
    else:
        if not (args.dataset and args.model):
            raise ValueError("dpclip audit --mode blackbox needs --dataset and --model")
        _check_dataset_name(args.dataset)
        _check_data_dir(args)
        config = TrainConfig(
            dataset=args.dataset, model=args.model, strategy=args.strategy,
            strategy_params=strategy_params, **unit.settings(),
            model_options=_options(MODELS, args.model, args.model_option, "--model-option"),
            dataset_options=_options(DATASETS, args.dataset, args.dataset_option,
                                     "--dataset-option"),
            epsilon=args.epsilon, noise_multiplier=args.noise_multiplier, delta=args.delta,
            epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
            optimizer=args.optimizer, momentum=args.momentum, accountant=args.accountant,
            reproducible_noise=args.reproducible_noise, max_physical_batch=args.max_physical_batch,
            device=args.device, sampling=args.sampling, engine=args.engine,
            data_dir=args.data_dir)
        b = blackbox_audit(config, n_canaries=args.canaries, canary=args.canary,
                           canary_scale=args.canary_scale, significance=args.significance,
                           claimed_epsilon=args.claim, progress=not args.no_progress)
        summary = {**record, **b.to_dict(), "claim_scope": "the whole training run"}
    store = ResultsStore(args.db or default_db_path())
    run_id = store.start_run(f"audit-{args.mode}-{args.strategy}-{args.seed}", record,
                             experiment="audit", label=f"{args.mode}:{args.strategy}")
    store.finish_run(run_id, dict(summary, run_id=run_id), {})
    store.close()
    _emit(dict(summary, run_id=run_id), args.json, audit_text(dict(summary, run_id=run_id), args))
    return 1 if summary["violates_claim"] else 0


def audit_text(summary: dict[str, Any], args: argparse.Namespace) -> str:
    """The audit's numbers, each named: the claim it tested (for white-box, ONE step's epsilon
    without sampling amplification, which can exceed the run's epsilon), the run's epsilon when
    known, each estimator, and which one is THE lower bound compared with the claim."""
    white = summary.get("mode") == "whitebox"
    claim = summary["claimed_epsilon"]
    lines = [f"{summary.get('mode')} audit of {summary.get('strategy')} (delta {args.delta:g}, "
             f"{summary.get('canaries')} canaries):"]
    if white:
        lines.append(f"  one-step claim:          epsilon {claim:.4g}  (what this audit tests: the "
                     "audited step alone, without the amplification of sampling)")
        if getattr(args, "epsilon", None) is not None:
            lines.append(f"  the run's epsilon:       {args.epsilon:g}  (all steps, with sampling "
                         "amplification; smaller than the one-step claim can be, and not tested "
                         "here)")
    else:
        lines.append(f"  claimed epsilon:         {claim:.4g}  (the whole training run; "
                     f"{summary.get('claim_source', 'run')})")
    est = [("one-run", summary.get("one_run_epsilon")),
           ("one-run f-DP", summary.get("one_run_fdp_epsilon"))]
    if white and summary.get("gaussian_epsilon") is not None:
        est.append(("gaussian fit", summary["gaussian_epsilon"]))
    lines.append(f"  empirical lower bound:   epsilon {summary['lower_bound']:.4g} at confidence "
                 f"{1 - args.significance:g}  <- THE bound compared with the claim (the largest "
                 "of: " + ", ".join(f"{n} {v:.4g}" for n, v in est if v is not None) + ")")
    if summary["violates_claim"]:
        lines.append(f"  verdict: FAIL (VIOLATION): the lower bound {summary['lower_bound']:.4g} "
                     f"exceeds the claim {claim:.4g}: the mechanism leaks more than claimed")
    else:
        lines.append(f"  verdict: PASS (no violation found): the lower bound "
                     f"{summary['lower_bound']:.4g} <= the claim {claim:.4g} (an audit refutes "
                     "claims, it cannot prove one)")
    lines.append(f"  stored as run {summary.get('run_id')}; plot: dpclip report audit")
    return "\n".join(lines)


def _whitebox_calibrated_z(args: argparse.Namespace, unit: Any,
                           strategy_params: dict[str, Any]) -> float:
    """The noise multiplier ``dpclip train`` would calibrate for ``--epsilon`` (public: the
    dataset's size, the sampler, the steps and the strategy's planned events; dpclip.training.plan)."""
    _check_dataset_name(args.dataset)
    _check_data_dir(args)
    bundle = load_dataset(args.dataset, args.data_dir, seed=args.seed,
                          **_options(DATASETS, args.dataset, args.dataset_option,
                                     "--dataset-option"))
    n = int(bundle.train.inputs.shape[0])
    if unit.public_fraction:  # the public split is carved out before the private run, each
        # example on its own (the trainer's split: its private part's size)
        n = len(independent_public_split(bundle.train, unit.public_fraction, args.seed)[1])
    if unit.unit == "gbc":
        s_size = int(unit.miniset_size or 1)
        sampler: Any = MiniSetSampler(n, s_size, int(args.batch_size) // s_size,
                                      partition_seed=args.seed)
    else:
        sampler = make_sampler(args.sampling, n, args.batch_size)
    strategy = make_strategy(args.strategy, strategy_params)
    pending = bundle.private_preprocessing  # e.g. centre="private": its release comes first
    plan = Plan(strategy, sampler, int(args.epochs) * int(sampler.steps_per_epoch),
                expected_units(unit, sampler),
                prior_events=(pending.event(),) if pending is not None else ())
    return float(resolve_noise(plan, epsilon=args.epsilon, noise_multiplier=None,
                               delta=args.delta, accountant=args.accountant, flags=CLI_FLAGS))


def _add_train_privacy_group(t: argparse.ArgumentParser) -> None:
    """``dpclip train``'s privacy group: the noise calibration, the accountant and the sampler."""
    g = t.add_argument_group("privacy (give --epsilon, --noise-multiplier, or both: then epsilon "
                             "is a cap and training stops before exceeding it)")
    g.add_argument("--epsilon", type=float, help="target epsilon: calibrates the noise")
    g.add_argument("--noise-multiplier", type=float, help="noise std / sensitivity")
    g.add_argument("--delta", type=float, default=None,
                   help="default: below 1/N for the N private examples (1e-5, or the power of ten "
                        "below 1/(10 N)), printed")
    g.add_argument("--accountant", default="pld", choices=["pld", "rdp"],
                   help="pld (tightest, default) or rdp")
    g.add_argument("--sampling", default="poisson", choices=["poisson", "fixed-size"],
                   help="poisson (add/remove-one) or fixed-size (replace-one, sensitivity x2)")


def _add_lr_schedule_group(t: argparse.ArgumentParser) -> None:
    """``dpclip train``'s learning-rate schedule group (post-processing)."""
    ls = t.add_argument_group(
        "learning-rate schedule (post-processing: no effect on privacy; stepped per optimizer "
        "step, saved in checkpoints; see docs/tuning.md)")
    ls.add_argument("--lr-schedule", default="constant",
                    choices=["constant", "step", "exponential", "cosine"],
                    help="constant (default); step: x --lr-gamma every --lr-step-epochs epochs; "
                         "exponential: x --lr-gamma per epoch (Nguyen et al.: 0.9); cosine: to "
                         "--lr-min over the run")
    ls.add_argument("--lr-gamma", type=float, help="step / exponential: the factor (0, 1]")
    ls.add_argument("--lr-step-epochs", type=int, help="step: epochs between two decays")
    ls.add_argument("--lr-min", type=float, help="cosine: the final learning rate (default 0)")
    ls.add_argument("--lr-warmup-epochs", type=float, default=0.0,
                    help="linear warm-up over this many epochs (fractions allowed), then the "
                         "schedule; default 0")


def _add_train_execution_arguments(t: argparse.ArgumentParser) -> None:
    """``dpclip train``'s public seed, engine, device and outputs (execution settings: none
    affects privacy except ``--reproducible-noise``, which labels the run NON-PRIVATE)."""
    t.add_argument("--seed", type=int, default=0,
                   help="public randomness: model initialisation, data splits (noise and batch "
                        "sampling draw from OS entropy; see --reproducible-noise)")
    t.add_argument("--reproducible-noise", action="store_true",
                   help="derive the noise and sampling generators from --seed (research only: the "
                        "run is NOT private against anyone who knows the seed, and is labelled so)")
    t.add_argument("--engine", default="auto",
                   help="per-example engine: auto (default: ghost where the model is proven "
                        "per-example separable, on its exported graph where that is proved, else "
                        "vmap; recorded), ghost, compiled (ghost on the proved graph; refuses the "
                        "models it cannot prove), vmap, naive")
    t.add_argument("--device", default="auto",
                   help="auto (default: cuda when present, else cpu), cpu, cuda or cuda:N; the "
                        "ledger is the same on every device (recorded in the summary)")
    t.add_argument("--eval-every", type=int, default=1, metavar="N",
                   help="evaluate on the test split every N epochs (default 1); 0: only at the "
                        "end (an execution setting: the model does not change)")
    t.add_argument("--max-physical-batch", type=int, default=None,
                   help="memory knob: examples per forward/backward chunk (results change "
                        "only in the last digits: the norms' rounding bound is taken for it); "
                        "default: the engine's own (ghost / auto: up to 4096 examples a pass, "
                        "the whole batch below; vmap / naive: 256 per-example gradients at a "
                        "time)")
    t.add_argument("--data-dir", help="directory with the dataset files; when given it is the "
                   "only place searched (else $DPCLIP_DATA, /usr/share/datasets/<name>)")
    t.add_argument("--db", help="SQLite results database (default $DPCLIP_DB or "
                   "./dpclip_results.db)")
    t.add_argument("--checkpoint-dir", help="write checkpoints here and resume from them")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--json", action="store_true", help="last stdout line is a JSON summary")
    t.add_argument("--evidence", metavar="FILE", default=None,
                   help="append the run's summary row to the evidence file FILE "
                        "(reproductions/results/NAME.json) and rewrite its Markdown table")
    t.set_defaults(func=cmd_train)


def _add_train_parser(sub: Any) -> None:
    """``dpclip train``: one DP-SGD run, stored."""
    t = sub.add_parser("train", help="train one model with DP-SGD and store the run")
    t.add_argument("--dataset", required=True, help="see `dpclip datasets`")
    t.add_argument("--model", required=True, help="see `dpclip models`")
    t.add_argument("--strategy", default="fixed", help="see `dpclip strategies` (default fixed)")
    t.add_argument("--param", action="append", metavar="K=V",
                   help="strategy parameter, e.g. --param clip_norm=0.1 (repeatable)")
    _add_unit_arguments(t)
    t.add_argument("--bn-stats", default="auto", choices=["auto", "batch", "public"],
                   help="BatchNorm evaluation statistics: test-batch, or recomputed on the "
                        "public split (auto: public when the run has one)")
    t.add_argument("--public-fraction", type=float, metavar="F",
                   help="share of the training set carved out as PUBLIC data (default 0.1 when "
                        "the strategy or --bn-stats public needs it, else 0)")
    t.add_argument("--model-option", action="append", metavar="K=V",
                   help="model option, e.g. --model-option activation=relu")
    t.add_argument("--dataset-option", action="append", metavar="K=V",
                   help="dataset option, e.g. --dataset-option n_train=1000 (synthetic)")
    _add_train_privacy_group(t)
    t.add_argument("--epochs", type=int, required=True)
    t.add_argument("--batch-size", type=float, default=256,
                   help="expected batch size (Poisson) or exact size (fixed-size); default 256")
    t.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    _add_lr_schedule_group(t)
    t.add_argument("--augment", default="none", metavar="OPS",
                   help="per-example image augmentation after the secret sampling, e.g. "
                        "crop:4,flip (random crop with padding 4, random horizontal flip; "
                        "crop:P:reflect pads with the mirrored border); default none. The "
                        "sensitivity is unchanged; test data is never augmented "
                        "(docs/privacy.md)")
    t.add_argument("--augment-multiplicity", type=int, default=1, metavar="K",
                   help="augmentation multiplicity (De et al. 2022): each sampled example is "
                        "augmented K times and its K gradients averaged before clipping; needs "
                        "--augment; sensitivity unchanged; default 1")
    t.add_argument("--averaging", default="none", metavar="SPEC",
                   help="weight averaging, evaluated and returned instead of the last iterate: "
                        "ema:D (decay D, (1+t)/(10+t) warm-up), ema:D:S (from step S) or polyak:S "
                        "(uniform mean after step S); default none; post-processing, no privacy "
                        "cost")
    t.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum", "adam"])
    t.add_argument("--momentum", type=float, default=0.9, help="for --optimizer momentum")
    _add_train_execution_arguments(t)


def _add_query_parsers(sub: Any) -> None:
    """``dpclip epsilon`` and the listings (``strategies``, ``datasets``, ``models``)."""
    e = sub.add_parser("epsilon", help="epsilon of Poisson-subsampled Gaussian DP-SGD")
    e.add_argument("--sample-rate", type=float, required=True)
    e.add_argument("--noise-multiplier", type=float, required=True)
    e.add_argument("--steps", type=int, required=True)
    e.add_argument("--delta", type=float, required=True)
    e.add_argument("--accountant", default="pld", choices=["pld", "rdp", "rdp-classic"])
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_epsilon)

    for name, helptext in (("strategies", "list clipping strategies"),
                           ("datasets", "list datasets"), ("models", "list models")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--json", action="store_true")
        s.set_defaults(func=cmd_list)


def _add_experiment_parsers(sub: Any) -> None:
    """``dpclip run``, ``compare``, ``report`` and ``reproductions``: the experiment harness."""
    for name, helptext in (("run", "run an experiment grid (TOML spec or preset name)"),
                           ("compare", "run a preset comparison and write its report")):
        r = sub.add_parser(name, help=helptext)
        if name == "run":
            r.add_argument("spec", help="TOML spec file or preset name")
            r.add_argument("--report", action="store_true", help="write the report afterwards")
        else:
            r.add_argument("--preset", dest="spec", default="quick",
                           help="preset name (default quick) or a TOML spec file")
            r.set_defaults(report=True)  # compare always writes its report
        r.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a spec value, e.g. --set train.epochs=1 "
                            "--set grid.seeds=[0,1]")
        r.add_argument("--workers", type=int, default=1, help="parallel worker processes")
        r.add_argument("--db", help="SQLite results database (default $DPCLIP_DB or "
                       "./dpclip_results.db)")
        r.add_argument("--out", help="directory for checkpoints and reports (default "
                       "$DPCLIP_OUT or ./runs)")
        r.add_argument("--no-progress", action="store_true")
        r.add_argument("--json", action="store_true")
        r.set_defaults(func=cmd_run)


    rp = sub.add_parser("report", help="Markdown + HTML report of an experiment from the store")
    rp.add_argument("experiment", help="experiment name, spec file or preset name")
    rp.add_argument("--db")
    rp.add_argument("--out", help="output directory (default $DPCLIP_OUT or ./runs)")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(func=cmd_report)

    rr = sub.add_parser("reproductions",
                        help="regenerate reproductions/results/*.json and docs/reproductions.md "
                             "from the store")
    rr.add_argument("--db")
    rr.add_argument("--dir", default="reproductions", help="directory of the specs")
    rr.add_argument("--doc", default="docs/reproductions.md")
    rr.set_defaults(func=cmd_reproductions)


def _add_bench_parser(sub: Any) -> None:
    """``dpclip bench``: step time of each engine."""
    b = sub.add_parser("bench", help="step time of each engine vs a non-private step")
    b.add_argument("--model", required=True, help="mlp, papernot-cnn, ...")
    b.add_argument("--batch-size", type=int, required=True)
    b.add_argument("--method", action="append",
                   help="methods to time (default: nonprivate and every dpclip engine)")
    b.add_argument("--steps", type=int, default=20, help="timed steps per method")
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--plot", metavar="FILE.html", help="also write the step times as a bar chart "
                   "(FILE.png) embedded in a self-contained HTML page")
    b.add_argument("--device", default="cpu",
                   help="cpu (default) or cuda: model and batch on the GPU, peak memory from "
                        "torch.cuda.max_memory_allocated")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)


def _add_audit_run_arguments(au: argparse.ArgumentParser) -> None:
    """``dpclip audit``'s dataset, model, training and output arguments (black-box runs, or
    the white-box calibration at ``--epsilon``)."""
    au.add_argument("--dataset", help="black-box, or white-box with --epsilon: see "
                    "`dpclip datasets`")
    au.add_argument("--model", help="black-box: see `dpclip models`")
    au.add_argument("--model-option", action="append", metavar="K=V")
    au.add_argument("--dataset-option", action="append", metavar="K=V")
    au.add_argument("--epochs", type=int, default=1)
    au.add_argument("--batch-size", type=float, default=256)
    au.add_argument("--lr", type=float, default=0.1)
    au.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum", "adam"])
    au.add_argument("--momentum", type=float, default=0.9)
    au.add_argument("--accountant", default="pld", choices=["pld", "rdp"])
    au.add_argument("--reproducible-noise", action="store_true",
                    help="black-box: the run's noise and sampling from --seed (as dpclip train)")
    au.add_argument("--max-physical-batch", type=int, default=None,
                    help="memory knob (results change only in the last digits); default: the "
                        "engine's own")
    au.add_argument("--device", default="cpu")
    au.add_argument("--canary", default="ood", choices=["ood", "mislabelled"],
                    help="black-box canaries: random out-of-distribution inputs with random labels "
                    "(default) or mislabelled test inputs")
    au.add_argument("--canary-scale", type=float, default=3.0,
                    help="black-box ood canaries' norm / the mean training-input norm")
    au.add_argument("--claim", type=float,
                    help="black-box: compare with this epsilon instead of the run's own (a "
                    "no-noise control: --noise-multiplier 0 --claim <the intended run's epsilon>)")
    au.add_argument("--data-dir")
    au.add_argument("--db", help="SQLite results database (default $DPCLIP_DB or "
                    "./dpclip_results.db)")
    au.add_argument("--no-progress", action="store_true")
    au.add_argument("--json", action="store_true")
    au.set_defaults(func=cmd_audit)


def _add_audit_parser(sub: Any) -> None:
    """``dpclip audit``: empirical epsilon lower bounds."""
    au = sub.add_parser("audit", help="empirical epsilon lower bound vs the claimed epsilon "
                        "(white-box: Dirac canaries in one step; black-box: canary examples "
                        "in a training run); see docs/audit.md")
    au.add_argument("--mode", default="whitebox", choices=["whitebox", "blackbox"])
    au.add_argument("--strategy", default="fixed", help="see `dpclip strategies`")
    au.add_argument("--param", action="append", metavar="K=V",
                    help="strategy parameter (repeatable)")
    _add_unit_arguments(au)
    au.add_argument("--engine", default="vmap", help="vmap, ghost, auto, naive, summed")
    au.add_argument("--sampling", default="poisson", choices=["poisson", "fixed-size"])
    au.add_argument("--noise-multiplier", type=float, help="noise std / sensitivity")
    au.add_argument("--epsilon", type=float, help="target epsilon of the run: black-box, the run "
                    "is calibrated to it; white-box (without --noise-multiplier), the step is "
                    "audited at the multiplier dpclip train calibrates (needs --dataset, "
                    "--epochs, --batch-size)")
    au.add_argument("--delta", type=float, required=True)
    au.add_argument("--canaries", type=int, default=4000)
    au.add_argument("--significance", type=float, default=0.05)
    au.add_argument("--seed", type=int, default=0,
                    help="the audit's coins and noise (reproducible: an audit is not a private run)")
    _add_audit_run_arguments(au)


def build_parser() -> argparse.ArgumentParser:
    """The ``dpclip`` argument parser: one builder per command (``_add_*_parser``)."""
    p = argparse.ArgumentParser(
        prog="dpclip",
        description="Differentially private training with gradient-clipping strategies.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    _add_train_parser(sub)
    _add_query_parsers(sub)
    _add_experiment_parsers(sub)
    _add_bench_parser(sub)
    _add_search_commands(sub)
    fl = sub.add_parser("fl", help="user-level DP-FedAvg with adaptive clipping "
                        "(dpclip.federated): train | flower-server | flower-client; "
                        "grids: `dpclip run` "
                        "with a [federated] spec")
    _fl_arguments(fl)
    fl.set_defaults(func=cmd_fl)

    _add_audit_parser(sub)
    return p


def cmd_fl(args: argparse.Namespace) -> int:
    """``dpclip fl ...``: see ``dpclip.federated.command``."""
    return run_command(args)


# -- Lin et al.'s greedy threshold search and stored schedules (dpclip.search) ------------------

def _resolve_train_config(config: Any, db: Any, checkpoint_dir: Any, progress: bool) -> Any:
    """``transfer`` schedule=NAME and ``lin-decay`` c0_from=greedy resolved from the store."""
    from pathlib import Path

    needs = (config.strategy == "transfer" and "schedule" in config.strategy_params) or (
        config.strategy == "lin-decay" and "c0_from" in config.strategy_params)
    if not needs:
        return config
    root = Path(checkpoint_dir) / "search" if checkpoint_dir else Path(_default_out()) / "search"
    with ResultsStore(db) as store:
        return resolve_strategy_params(config, store, checkpoint_root=root, progress=progress)


def cmd_search(args: argparse.Namespace) -> int:
    from pathlib import Path

    _check_dataset_name(args.dataset)
    _check_dataset_name(args.proxy_for, "--proxy-for")
    _check_data_dir(args)
    size = args.private_size
    if size is None and args.proxy_for is not None and (
            args.private_epsilon is not None or args.match_private_epoch):
        size = int(load_dataset(args.proxy_for, args.data_dir).train.inputs.shape[0])
    if (args.noise_multiplier is None) == (args.private_epsilon is None):
        raise SystemExit("error: give exactly one of --noise-multiplier (the private run's sigma) "
                         "or --private-epsilon (with --proxy-for or --private-size)")
    z = args.noise_multiplier
    if z is None:
        if size is None:
            raise SystemExit("error: --private-epsilon needs the private dataset's size: "
                             "--proxy-for DATASET or --private-size N")
        z = search_noise_multiplier(args.private_epsilon, args.delta,
                                    batch_size=args.batch_size, epochs=args.epochs,
                                    dataset_size=size, sampling=args.sampling,
                                    accountant=args.accountant)
    spe = args.steps_per_epoch
    if args.match_private_epoch:
        if size is None:
            raise SystemExit("error: --match-private-epoch needs --proxy-for or --private-size")

        spe = make_sampler(args.sampling, size, args.batch_size).steps_per_epoch
    config = GreedyConfig(
        dataset=args.dataset, model=args.model, noise_multiplier=z,
        batch_size=args.batch_size, lr=args.lr, epochs=args.epochs, c_start=args.c_start,
        step=args.step, tolerance=args.tolerance, max_candidates=args.max_candidates,
        steps_per_epoch=spe, seed=args.seed, optimizer=args.optimizer, momentum=args.momentum,
        sampling=args.sampling, engine=args.engine,
        max_physical_batch=args.max_physical_batch,
        model_options=_options(MODELS, args.model, args.model_option, "--model-option"),
        proxy_for=args.proxy_for, allow_private_data=args.nonprivate_search,
        data_dir=args.data_dir, device=args.device,
    )
    privacy = check_public(config)  # refuse early, before loading anything
    if privacy == "NON-PRIVATE":
        print(f"dpclip search: WARNING: {config.dataset!r} is marked private; this search is NOT "
              "differentially private and its schedule is stored marked NON-PRIVATE",
              file=sys.stderr)
    name = args.name or default_schedule_name(config)
    ck_root = Path(args.checkpoint_dir) if args.checkpoint_dir else Path(_default_out()) / "search"
    with ResultsStore(args.db or default_db_path()) as store:
        name, thresholds, meta = run_or_reuse(config, store, name=name, checkpoint_root=ck_root,
                                              progress=not args.no_progress)
        db = str(store.path)
    obj = {"name": name, "thresholds": thresholds, "db": db,
           **{k: meta.get(k) for k in ("dataset", "model", "noise_multiplier", "batch_size",
                                       "lr", "epochs", "seed", "steps_per_epoch", "privacy",
                                       "best_accuracies", "candidates_per_epoch",
                                       "wall_seconds")}}
    _emit(obj, args.json,
          f"schedule {name!r} ({meta.get('privacy')}; no epsilon: the search is not private on "
          f"the data it ran on) stored in {db}:\n  thresholds per epoch: "
          + ", ".join(f"{c:g}" for c in thresholds)
          + "\n  best accuracy per epoch: "
          + ", ".join(f"{a:.4f}" for a in meta.get("best_accuracies", [])))
    return 0


def cmd_schedules(args: argparse.Namespace) -> int:
    with ResultsStore(args.db or default_db_path()) as store:
        rows = store.schedules()
    if not args.candidates:
        for r in rows:
            r["metadata"] = {k: v for k, v in r["metadata"].items() if k != "candidates"}
    if args.json:
        print(json.dumps({"schedules": rows}, default=str))
        return 0
    if not rows:
        print("no stored schedules (create one with `dpclip search`)")
    for r in rows:
        m = r["metadata"]
        th = ", ".join(f"{c:g}" for c in r["thresholds"])
        print(f"{r['name']}\n    {m.get('dataset')}/{m.get('model')} sigma "
              f"{m.get('noise_multiplier', float('nan')):.4g} B {m.get('batch_size')} lr "
              f"{m.get('lr')} seed {m.get('seed')} [{m.get('privacy')}]\n    thresholds: {th}")
    return 0


def cmd_search_report(args: argparse.Namespace) -> int:
    from dpclip.search.plots import plot_median_norms, plot_thresholds

    out = Path(args.out or _default_out())
    plots = []
    with ResultsStore(args.db or default_db_path()) as store:
        names = list(args.schedule or [])
        if args.schedule_prefix:
            names += [r["name"] for r in store.schedules()
                      if r["name"].startswith(args.schedule_prefix) and r["name"] not in names]
        if names:
            plots.append(plot_thresholds(store, names, out / f"{args.prefix}_thresholds.png",
                                         experiments=args.experiment or ()))
        if args.norms_experiment:
            plots.append(plot_median_norms(store, args.norms_experiment,
                                           out / f"{args.prefix}_median_norms.png"))
    if not plots:
        raise SystemExit("error: nothing to plot: give --schedule/--schedule-prefix and/or "
                         "--norms-experiment")
    if args.json:
        print(json.dumps({"plots": [str(p) for p in plots]}))
    else:
        for p in plots:
            print(p)
    return 0


def _add_search_commands(sub: Any) -> None:
    s = sub.add_parser("search", help="Lin et al.'s greedy per-epoch threshold search on PUBLIC "
                       "data; stores the schedule (no epsilon: not private on its data)")
    s.add_argument("--dataset", required=True, help="a public dataset (mnist-5k, digits) or a "
                   "declared proxy (--proxy-for)")
    s.add_argument("--model", required=True)
    g = s.add_argument_group("noise: the private run's sigma, given or calibrated")
    g.add_argument("--noise-multiplier", type=float, help="sigma of the private run")
    g.add_argument("--private-epsilon", type=float,
                   help="calibrate sigma for the private run at this epsilon (same batch size "
                        "and epochs, dataset size from --proxy-for or --private-size)")
    g.add_argument("--delta", type=float, default=1e-5, help="with --private-epsilon")
    g.add_argument("--accountant", default="pld", choices=["pld", "rdp"])
    g.add_argument("--private-size", type=int, help="size of the private training set")
    s.add_argument("--proxy-for", help="the private dataset this search is a public proxy for "
                   "(e.g. fashion-mnist); declares pairs such as fashion-mnist for mnist public")
    s.add_argument("--match-private-epoch", action="store_true",
                   help="one search epoch = as many steps as one epoch of the private dataset")
    s.add_argument("--steps-per-epoch", type=int, help="steps of one search epoch")
    s.add_argument("--batch-size", type=float, required=True)
    s.add_argument("--lr", type=float, required=True)
    s.add_argument("--epochs", type=int, required=True)
    s.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum", "adam"])
    s.add_argument("--momentum", type=float, default=0.9)
    s.add_argument("--sampling", default="poisson", choices=["poisson", "fixed-size"])
    s.add_argument("--c-start", type=float, default=0.05, help="C_start (Lin et al.: 0.05)")
    s.add_argument("--step", type=float, default=0.01, help="d (Lin et al.: 0.01)")
    s.add_argument("--tolerance", type=float, default=0.02,
                   help="S: stop when accuracy falls more than S below the best (0.02)")
    s.add_argument("--max-candidates", type=int, default=1000, help="safety cap per epoch")
    s.add_argument("--model-option", action="append", metavar="K=V")
    s.add_argument("--name", help="store name (default: derived from the setting and a hash)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--engine", default="auto",
                   help="auto (default), ghost, compiled, vmap, naive")
    s.add_argument("--max-physical-batch", type=int, default=None,
                   help="memory knob (results change only in the last digits); default: the "
                        "engine's own")
    s.add_argument("--device", default="cpu")
    s.add_argument("--data-dir")
    s.add_argument("--db", help="SQLite results database (default $DPCLIP_DB or "
                   "./dpclip_results.db)")
    s.add_argument("--checkpoint-dir", help="checkpoint root (default $DPCLIP_OUT/search); a "
                   "killed search resumes from <dir>/<name>")
    s.add_argument("--nonprivate-search", action="store_true",
                   help="allow a dataset marked private: the search is NOT private and its "
                        "schedule is stored marked NON-PRIVATE (transfer refuses it)")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_search)

    ls = sub.add_parser("schedules", help="list the threshold schedules in the results store")
    ls.add_argument("--db")
    ls.add_argument("--candidates", action="store_true",
                    help="include every candidate of the searches (with --json)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_schedules)

    sr = sub.add_parser("search-report", help="plots: greedy thresholds vs other strategies "
                        "(Lin Figs. 2-5), median gradient norms for fixed clipping (Fig. 1)")
    sr.add_argument("--schedule", action="append", help="stored schedule name (repeatable)")
    sr.add_argument("--schedule-prefix", help="every stored schedule whose name starts so")
    sr.add_argument("--experiment", action="append",
                    help="experiment whose runs' thresholds are drawn beside (repeatable)")
    sr.add_argument("--norms-experiment", action="append",
                    help="experiment with fixed-clipping runs recorded with diagnostics "
                         "(repeatable)")
    sr.add_argument("--prefix", default="lin", help="file name prefix (default lin)")
    sr.add_argument("--db")
    sr.add_argument("--out", help="output directory (default $DPCLIP_OUT or ./runs)")
    sr.add_argument("--json", action="store_true")
    sr.set_defaults(func=cmd_search_report)


def _check_data_dir(args: argparse.Namespace) -> None:
    """An explicit ``--data-dir`` must exist: never a silent fallback to other data."""
    import os

    d = getattr(args, "data_dir", None)
    if d is not None and not os.path.isdir(d):
        raise FileNotFoundError(
            f"--data-dir {d!r}: no such directory; give the directory that holds the dataset's "
            "files (see `dpclip datasets`), or leave --data-dir out to search $DPCLIP_DATA and "
            "/usr/share/datasets"
        )


def _check_dataset_name(name: str | None, flag: str = "--dataset") -> None:
    if name is not None and name not in DATASETS:
        raise ValueError(f"{flag}: {unknown_name('dataset', name, DATASETS)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; errors print ``dpclip CMD: error: ...`` on stderr and return 2, dpclip's
    warnings (``dpclip.errors.DpclipWarning``) print ``dpclip CMD: warning: ...``."""
    import warnings

    parser = build_parser()
    args = parser.parse_args(argv)
    args.train_argv = list(sys.argv[1:] if argv is None else argv)  # recorded by --evidence

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if issubclass(category, DpclipWarning):
            print(f"dpclip {args.command}: warning: {message}", file=sys.stderr)
        else:
            default_show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        default_show = warnings.showwarning
        warnings.simplefilter("always", DpclipWarning)
        warnings.showwarning = show
        try:
            return int(args.func(args) or 0)
        except (ValueError, OSError, RuntimeError) as exc:
            print(f"dpclip {args.command}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as exc:  # Ctrl-C: no traceback; say how to resume

            text = (exc.message("run the same command") if isinstance(exc, TrainingInterrupted)
                    else "interrupted (Ctrl-C)")
            print(f"dpclip {args.command}: {text}", file=sys.stderr)
            return 130


#: subcommands that keep the allocator they were started with (``bench`` measures it as given)
_KEEP_ALLOCATOR = ("bench",)


def entry() -> None:
    """Console entry point (``dpclip``): re-executes once under jemalloc without purging when it is
    installed (``dpclip.runtime``; ``DPCLIP_ALLOCATOR=system`` turns this off), then runs ``main``.
    ``main(argv)`` itself never re-executes (tests and library callers use it)."""
    if not any(a in _KEEP_ALLOCATOR for a in sys.argv[1:2]):
        maybe_reexec_with_jemalloc()
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    entry()

"""``dpclip fl``: user-level DP-FedAvg from the command line.

    dpclip fl train --dataset synthetic --num-users 50 --rounds 30 --clients-per-round 10 \
        --strategy quantile --noise-multiplier 0.5 --delta 1e-3 [--param K=V] [--json]
    dpclip fl flower-server|flower-client ...   (Flower runtime; needs dpclip[flower])

``--spec`` (TOML or JSON) holds the keys of ``dpclip.federated.spec`` at the top level or in a
``[federated]`` table (an experiment spec's table: its grid is ignored, flags override it).
Grids of federated runs (strategies x user-level epsilons x seeds, the results store, resume,
reports) are experiment specs with a ``[federated]`` table, run by ``dpclip run SPEC``
(``dpclip.harness``).
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path
from typing import Any

from dpclip.accounting import Ledger
from dpclip.federated.launch import run_local_deployment
from dpclip.federated.simulation import run_fedavg
from dpclip.federated.spec import FederatedRunConfig, build_run
from dpclip.store import ResultsStore, default_db_path

__all__ = ["add_arguments", "run_command"]


def _kv(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="fl_command", required=True)
    t = sub.add_parser("train", help="one user-level DP-FedAvg run (in process)")
    t.add_argument("--spec", help="TOML/JSON spec (flags below override it)")
    t.add_argument("--dataset")
    t.add_argument("--dataset-option", action="append", metavar="K=V")
    t.add_argument("--data-dir")
    t.add_argument("--num-users", type=int)
    t.add_argument("--partition", choices=["iid", "label-skew", "dirichlet", "attribute", "natural"],
                   help="how a centralised dataset is split into users (default iid); natural: "
                        "the clients of a TFF federated dataset (its default)")
    t.add_argument("--model")
    t.add_argument("--model-option", action="append", metavar="K=V")
    t.add_argument("--strategy", help="fixed, quantile, lin-decay, ... (see `dpclip strategies`)")
    t.add_argument("--param", action="append", metavar="K=V", help="strategy parameter")
    t.add_argument("--rounds", type=int)
    t.add_argument("--clients-per-round", type=float, help="expected users per round (m)")
    t.add_argument("--sampling", choices=["poisson", "fixed-size"])
    t.add_argument("--noise-multiplier", type=float)
    t.add_argument("--epsilon", type=float, help="user-level target epsilon (calibrates z)")
    t.add_argument("--delta", type=float)
    t.add_argument("--accountant", choices=["pld", "rdp"])
    t.add_argument("--local-epochs", type=int)
    t.add_argument("--local-batch-size", type=int)
    t.add_argument("--client-lr", type=float)
    t.add_argument("--server-optimizer", choices=["sgd", "momentum", "adam"])
    t.add_argument("--server-lr", type=float)
    t.add_argument("--server-momentum", type=float)
    t.add_argument("--seed", type=int)
    t.add_argument("--reproducible-noise", action="store_true", default=None,
                   help="derive noise and sampling from --seed (NOT private; labelled so)")
    t.add_argument("--eval-every", type=int)
    t.add_argument("--weight-cap", type=int, help="declared capped weights min(n_u / CAP, 1) "
                   "from the users' example counts (declared public); default equal weights")
    t.add_argument("--json", action="store_true", help="print the summary as JSON")
    t.add_argument("--db", help="results database (default $DPCLIP_DB or ./dpclip_results.db)")
    fw = sub.add_parser("flower", help="one run on Flower's deployment engine on this machine: "
                        "a SuperLink, one SuperNode per user and `flwr run` (docs/federated.md)")
    fw.add_argument("--spec", required=True, help="JSON spec of the run (docs/federated.md)")
    fw.add_argument("--out", help="write the result JSON here")
    fw.add_argument("--timeout", type=float, help="seconds for the whole run (default 120 + 20 "
                    "per user and round); every process is stopped when it expires")
    fw.add_argument("--workdir", help="where the app, Flower's state and the logs go "
                    "(default a new temporary directory)")
    fw.add_argument("--db", help="results database (default $DPCLIP_DB or ./dpclip_results.db)")
    fw.add_argument("--json", action="store_true", help="print the result summary as JSON")
    for role in ("server", "client"):
        f = sub.add_parser(f"flower-{role}", help=f"Flower {role} process (needs dpclip[flower])")
        f.add_argument("--address", required=True)
        f.add_argument("--spec", required=True, help="JSON spec")
        if role == "server":
            f.add_argument("--out")
            f.add_argument("--wait-timeout", type=float, default=None,
                           help="seconds to wait for every user's client (default 30 + 10 per "
                           "user)")
        else:
            f.add_argument("--user", type=int, required=True)


def _load_spec(path: str) -> dict[str, Any]:
    text = Path(path).read_text()
    data = tomllib.loads(text) if path.endswith(".toml") else json.loads(text)
    return data


def _train_spec(args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if args.spec:
        raw = _load_spec(args.spec)
        spec.update(raw.get("federated", {k: v for k, v in raw.items()
                                          if k not in ("grid", "name", "description")}))
    flags = {
        "dataset": args.dataset, "data_dir": args.data_dir, "num_users": args.num_users,
        "partition": args.partition, "model": args.model, "strategy": args.strategy,
        "rounds": args.rounds, "clients_per_round": args.clients_per_round,
        "sampling": args.sampling, "noise_multiplier": args.noise_multiplier,
        "epsilon": args.epsilon, "delta": args.delta, "accountant": args.accountant,
        "local_epochs": args.local_epochs, "local_batch_size": args.local_batch_size,
        "client_lr": args.client_lr, "server_optimizer": args.server_optimizer,
        "server_lr": args.server_lr, "server_momentum": args.server_momentum, "seed": args.seed,
        "reproducible_noise": args.reproducible_noise, "eval_every": args.eval_every,
        "weight_cap": args.weight_cap,
    }
    spec.update({k: v for k, v in flags.items() if v is not None})
    for key, items in (("dataset_options", args.dataset_option),
                       ("model_options", args.model_option), ("params", args.param)):
        if items:
            spec[key] = {**spec.get(key, {}), **_kv(items)}
    return spec


def _run_one(spec: dict[str, Any], callback: Any = None) -> Any:

    data, model, strategy, config = build_run(spec)
    return run_fedavg(data, model, strategy, config, callback=callback), strategy


def _round_line(row: dict[str, Any], rounds: int) -> str:
    return (f"round {row['round']:>4}/{rounds}  test_acc {row['test_accuracy']:.4f}  "
            f"clip {row['clip_norm']:.4g}  eps {row['epsilon']:.4g}")


def _train_stored(spec: dict[str, Any], args: argparse.Namespace) -> Any:
    """``dpclip fl train``: the run, printed per evaluated round (stderr with --json), stored in
    the results store like every run (``kind = "federated"``; config checked first, so a refused
    spec leaves no row)."""
    import sys

    run = FederatedRunConfig(spec)  # validates the plan before anything is stored
    store = ResultsStore(getattr(args, "db", None) or default_db_path())
    rid = store.start_run(run.fingerprint(), run.to_dict(), experiment="fl-train",
                          label=f"fl:{run.spec['strategy']}")
    out = sys.stderr if args.json else sys.stdout

    def on_round(row: dict[str, Any]) -> None:
        store.log_epoch(rid, row["round"], {**row, "epoch": row["round"],
                                            "clip_threshold": row["clip_norm"]})
        print(_round_line(row, int(run.spec["rounds"])), file=out, flush=True)

    try:
        res, strategy = _run_one(dict(run.spec), callback=on_round)
    except BaseException as exc:
        store.fail_run(rid, f"{type(exc).__name__}: {exc}")
        store.close()
        raise
    sm = res.summary  # the keys a federated grid's run has (dpclip.federated.spec.run_from_config)
    store.finish_run(rid, {**sm, "model": run.spec["model"], "strategy": strategy.name,
                           "params": strategy.describe(), "epochs": sm["rounds"],
                           "privacy_unit": "user", "expected_batch_size": sm["expected_clients"],
                           "lr": sm["server_lr"], "optimizer": sm["server_optimizer"]},
                     res.ledger.to_dict())
    store.close()
    res.summary["run_id"], res.summary["db"] = rid, str(store.path)
    return res


def _flower_deployment(args: argparse.Namespace) -> int:
    """``dpclip fl flower``: dpclip.federated.launch, then the run in the results store."""
    import sys

    spec = _load_spec(args.spec)
    run = FederatedRunConfig(spec)  # the plan checked before anything starts
    out = sys.stderr if args.json else sys.stdout
    result = run_local_deployment(args.spec, out=args.out, timeout=args.timeout,
                                  workdir=args.workdir,
                                  echo=lambda line: print(line, file=out, flush=True))

    summary = {k: v for k, v in result.items() if k not in ("ledger", "theta")}
    summary.update(strategy=run.spec["strategy"], dataset=run.spec["dataset"],
                   runtime="flower-deployment")
    with ResultsStore(args.db or default_db_path()) as store:
        rid = store.start_run(run.fingerprint(), run.to_dict(),
                              label=f"fl-flower:{run.spec['strategy']}")
        store.finish_run(rid, summary, Ledger.from_dict(result["ledger"]).to_dict())
    summary["run_id"] = rid
    if args.json:
        print(json.dumps(summary, default=str))
    else:
        acc = summary.get("test_accuracy")
        print(f"user-level DP-FedAvg on Flower: {summary['rounds']} rounds, test accuracy "
              f"{'-' if acc is None else f'{100 * acc:.2f} %'}, epsilon {summary['epsilon']:.3f} "
              f"at delta {run.spec['delta']:g}"
              + (f"; NON-PRIVATE: {len(summary['nonprivate/failures'])} client failures"
                 if "nonprivate/failures" in summary else "") + f"; stored as run {rid}")
    return 0


def run_command(args: argparse.Namespace) -> int:
    if args.fl_command == "train":
        res = _train_stored(_train_spec(args), args)
        s = {**res.summary, "history": res.history}
        if args.json:
            print(json.dumps(s, default=str))
        else:
            print(f"user-level DP-FedAvg: {s['strategy']} on {s['dataset']} "
                  f"({s['num_users']} users, m={s['expected_clients']:g}, {s['rounds']} rounds): "
                  f"test accuracy {100 * s['test_accuracy']:.2f} %, epsilon {s['epsilon']:.3f} "
                  f"at delta {s['delta']:g} ({s['accountant']}), final clip "
                  f"{res.clip_history[-1]:.4g}; randomness {s['randomness']}; stored as run "
                  f"{s['run_id']} in {s['db']}")
        return 0
    from dpclip.federated import flower  # the optional extra: a clear ImportError without it

    if args.fl_command == "flower":
        return _flower_deployment(args)

    argv = [args.fl_command.split("-")[1], "--address", args.address, "--spec", args.spec]
    if args.fl_command == "flower-server":
        argv += (["--wait-timeout", str(args.wait_timeout)] if args.wait_timeout else []) \
            + (["--out", args.out] if args.out else [])
    else:
        argv += ["--user", str(args.user)]
    return flower.main(argv)

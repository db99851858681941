"""DP-FedAvg on Flower (``flwr``): a server strategy and a client built on dpclip's aggregator.

Optional extra: ``pip install dpclip[flower]``. The server side is :class:`DPFedAvgStrategy`, a
``flwr.server.strategy.Strategy`` that delegates every privacy-relevant step to the SAME
:class:`~dpclip.federated.server.FedAvgServer` the in-process simulation uses: user sampling from
``PrivateRandomness.sampling``, clipping with the dpclip strategy, one Gaussian noise draw on the
sum, division by the public expected number of users, the quantile count and the ledger. With
the same spec and ``PrivateRandomness.reproducible(seed)`` a Flower run and ``run_fedavg`` record
equal ledgers and end with the same parameters (tested).

Two runtimes, the same strategy and client (Flower 1.42; both tested on localhost):

* **Deployment engine** (Flower's recommended runtime): :data:`server_app` (a ``ServerApp``) and
  :data:`client_app` (a ``ClientApp``) in a Flower App written by :func:`write_flower_app`, run by
  ``flwr run APP`` on a SuperLink (``flower-superlink --insecure``) with one SuperNode per user
  (``flower-supernode --insecure --node-config "user=U"``). The app's run config names the spec
  (JSON) and the result file.
* **Legacy gRPC API**: ``flwr.server.start_server`` / ``flwr.client.start_client`` (deprecated by
  Flower since 1.13, still shipped): ``python -m dpclip.federated.flower server|client``.

Flower's simulation engine (``flwr.simulation``, Ray-based) is not used: Ray is not installed
here (docs/federated.md says exactly what was tried).

Model of trust: central DP with a trusted server (as in Andrew et al.): clients send raw deltas
to the server, which privatizes them; nothing reported by Flower (``num_examples`` is sent as 1,
metrics carry only the user id) is released by dpclip. Each client process hosts one user.

Command line (what the test and ``dpclip fl flower-*`` launch)::

    python -m dpclip.federated.flower server --address 127.0.0.1:PORT --spec run.json --out res.json
    python -m dpclip.federated.flower client --address 127.0.0.1:PORT --spec run.json --user 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

try:  # the optional extra
    import flwr
    from flwr.common import (
        FitIns,
        GetPropertiesIns,
        Parameters,
        ndarrays_to_parameters,
        parameters_to_ndarrays,
    )
    from flwr.server.strategy import Strategy
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "dpclip.federated.flower needs Flower: pip install 'dpclip[flower]' (or pip install flwr)"
    ) from exc

from dpclip.accounting import compute_epsilon
from dpclip.data.base import TensorSplit
from dpclip.federated.client import LocalTraining, local_seed, local_update, user_key
from dpclip.federated.server import FedAvgServer
from dpclip.federated.simulation import FedAvgConfig, build_server, declared_weights
from dpclip.federated.spec import build_data, build_model_for, build_run, config_from_spec
from dpclip.randomness import PrivateRandomness

__all__ = ["DPFedAvgStrategy", "UserClient", "client_app", "flower_apps", "main", "run_client",
           "run_server", "server_app", "write_flower_app"]

USER_KEY = "dpclip_user_id"


class DPFedAvgStrategy(Strategy):
    """Flower strategy: each round, the dpclip server samples users, the clients hosting them
    train locally, and :meth:`FedAvgServer.finish_round` privatizes and applies their deltas.

    Client sampling is dpclip's (secret, ``PrivateRandomness.sampling``), not Flower's
    ``ClientManager.sample``. An empty round (Poisson) is privatized at configuration time (pure
    noise update, ledger entry) because Flower skips ``aggregate_fit`` for rounds with no client.
    A sampled user whose client fails contributes nothing that round (the clipped sum and its
    sensitivity are unaffected; the denominator stays the public constant).
    """

    def __init__(self, server: FedAvgServer, config: FedAvgConfig, *,
                 wait_timeout: float = 60.0, rpc_timeout: float | None = 60.0) -> None:
        super().__init__()
        self.server = server
        self.config = config
        self.wait_timeout = wait_timeout
        self.rpc_timeout = rpc_timeout
        self._proxies: dict[int, Any] = {}
        self._sampled: frozenset[int] = frozenset()  # the users of the current round
        self.failures: list[str] = []
        self.round_clips: list[float] = []

    def __repr__(self) -> str:
        return f"DPFedAvgStrategy({self.server.aggregator.strategy!r})"

    # -- parameters -------------------------------------------------------------------------------
    def _parameters(self) -> Parameters:
        return ndarrays_to_parameters([self.server.theta.numpy().copy()])

    def initialize_parameters(self, client_manager: Any) -> Parameters | None:
        return self._parameters()

    # -- users <-> Flower clients ---------------------------------------------------------------
    def _map_users(self, client_manager: Any) -> None:
        n = self.server.aggregator.sampler.dataset_size
        if len(self._proxies) == n:
            return
        if not client_manager.wait_for(n, timeout=int(self.wait_timeout)):
            raise RuntimeError(
                f"DPFedAvgStrategy: {n} user clients must be connected (one per user), only "
                f"{client_manager.num_available()} after {self.wait_timeout} s")
        for proxy in client_manager.all().values():
            res = proxy.get_properties(GetPropertiesIns({}), timeout=self.rpc_timeout,
                                       group_id=None)
            self._proxies[int(res.properties[USER_KEY])] = proxy
        if sorted(self._proxies) != list(range(n)):
            raise RuntimeError(f"DPFedAvgStrategy: clients report users {sorted(self._proxies)}, "
                               f"expected 0..{n - 1}")

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: Any) -> list[tuple[Any, FitIns]]:
        self._map_users(client_manager)
        users = self.server.sample_users()
        self._sampled = frozenset(int(u) for u in users)
        if not users:  # Flower would skip the round: privatize it here (noise + ledger)
            out = self.server.finish_round([], [])
            self.round_clips.append(out.clip_norm)
            self._announce(out.clip_norm)  # (the same line as a round with users)
            return []
        cfg = {"round": self.server.round_index, "seed": self.config.seed,
               "epochs": self.config.local.epochs, "batch_size": self.config.local.batch_size,
               "lr": float(self.config.local.lr)}
        params = self._parameters()
        return [(self._proxies[u], FitIns(params, {**cfg, USER_KEY: u})) for u in users]

    def aggregate_fit(self, server_round: int, results: list[tuple[Any, Any]],
                      failures: list[Any]) -> tuple[Parameters | None, dict[str, Any]]:
        # the kind of each failure only: a client's exception text may quote its data's shapes
        self.failures += [_failure_kind(f) for f in failures]
        d = self.server.theta.numel()
        # validate every result before anything is privatized or recorded in the ledger
        got = sorted(_checked_results(results, self._sampled, d, server_round),
                     key=lambda item: item[0])
        deltas = (torch.stack([torch.from_numpy(np.asarray(a, dtype=np.float32)).reshape(-1)
                               for _, a in got]) if got else torch.zeros(0, d))
        out = self.server.finish_round(deltas, [u for u, _ in got])
        self.round_clips.append(out.clip_norm)
        # no failure count: whether a client failed shows that it was (secretly) sampled, and
        # a failure can depend on its data (twelfth hostile review); kept only as NON-PRIVATE
        self._announce(out.clip_norm)
        return self._parameters(), {"clip_norm": out.clip_norm}

    def _announce(self, clip_norm: float) -> None:
        """The round's line, printed for EVERY round, with users or none: printed only where
        ``aggregate_fit`` ran, its absence showed the rounds whose secret Poisson sample was
        empty (unnoised, unaccounted: membership told with 84 % accuracy at an accounted user
        epsilon of 0.051; hundred-and-twenty-ninth hostile review). The clip is a release."""
        print(f"dpclip fl: round {self.server.round_index}/{self.config.rounds} done, clip "
              f"{clip_norm:.4g}", flush=True)

    # -- no federated evaluation (centralised evaluation is done by the caller) ----------------
    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: Any) -> list:
        return []

    def aggregate_evaluate(self, server_round: int, results: list, failures: list
                           ) -> tuple[float | None, dict[str, Any]]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters
                 ) -> tuple[float, dict[str, Any]] | None:
        return None


def _failure_kind(failure: Any) -> str:
    """A client failure as the run's public result keeps it: the exception's type, or the fit
    result's status code, never a message (a client's message can quote its data's shapes)."""
    if isinstance(failure, BaseException):
        return type(failure).__name__
    try:
        return f"status {failure[1].status.code.name}"
    except (AttributeError, IndexError, TypeError):
        return type(failure).__name__


def _checked_results(results: list[tuple[Any, Any]], sampled: frozenset[int], d: int,
                     server_round: int) -> list[tuple[int, Any]]:
    """``(user, delta)`` of each fit result, after checking that every result names a user
    sampled this round, once, with one delta of the model's size ``d``. Raises ``ValueError``
    (naming the user, never a value) before anything is privatized or recorded: a user counted
    twice would double its influence on the clipped sum, past the sensitivity the ledger
    accounts."""
    seen: set[int] = set()
    out: list[tuple[int, Any]] = []
    for _, res in results:
        try:
            user = int(res.metrics[USER_KEY])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"aggregate_fit (round {server_round}): a fit result carries no "
                             f"integer {USER_KEY!r} metric; nothing was recorded") from None
        if user in seen:
            raise ValueError(
                f"aggregate_fit (round {server_round}): two results claim user {user}; each "
                "sampled user contributes one delta (a second would double its influence past "
                "the accounted sensitivity). Nothing was recorded: check the clients' user ids")
        if user not in sampled:
            raise ValueError(
                f"aggregate_fit (round {server_round}): a result claims user {user}, which was "
                "not sampled this round; nothing was recorded")
        seen.add(user)
        arrays = parameters_to_ndarrays(res.parameters)
        if len(arrays) != 1 or int(np.asarray(arrays[0]).size) != d:
            raise ValueError(
                f"aggregate_fit (round {server_round}): the delta of user {user} is not one "
                f"array of the model's {d} parameters; nothing was recorded (is the client "
                "running the same model?)")
        out.append((user, arrays[0]))
    return out


class UserClient(flwr.client.NumPyClient):
    """One user's device: local SGD from the received global model, returns the delta."""

    def __init__(self, user_id: int, data: TensorSplit, model: torch.nn.Module,
                 loss_fn: Any = None) -> None:
        self.user_id, self.data, self.model = int(user_id), data, model
        self.loss_fn = loss_fn

    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        return {USER_KEY: self.user_id}

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]
            ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        if int(config[USER_KEY]) != self.user_id:
            raise ValueError(f"client of user {self.user_id} got instructions for user "
                             f"{config[USER_KEY]}")
        theta = torch.from_numpy(np.asarray(parameters[0], dtype=np.float32).copy())
        training = LocalTraining(int(config["epochs"]), int(config["batch_size"]),
                                 float(config["lr"]))
        delta = local_update(self.model, theta, self.data, training, loss_fn=self.loss_fn,
                             seed=local_seed(int(config["seed"]), int(config["round"]),
                                             user_key(self.data)))
        return [delta.numpy()], 1, {USER_KEY: self.user_id}


def default_wait_timeout(num_users: int) -> float:
    """Seconds the server waits for every user's client: 30 s plus 10 s per client (each client
    process imports torch and builds its data; 6 clients starting on 2 cores took over 60 s)."""
    return 30.0 + 10.0 * max(int(num_users), 1)


def _server_for(spec: dict[str, Any], wait_timeout: float | None
                ) -> tuple[DPFedAvgStrategy, FedAvgConfig]:
    """The server's strategy for ``spec``: every check of the configuration (the plan, the
    strategy and its parameters, the noise, the users' data) happens here, before any client is
    needed; clients run the same checks (:func:`check_spec`) and exit on a refusal."""
    data, model, strategy, config = build_run(spec)
    randomness = PrivateRandomness.for_run(config.reproducible_noise, config.seed)
    server = build_server(model, strategy, config, data.num_users, randomness=randomness,
                          user_weights=declared_weights(config, data))
    wait = default_wait_timeout(data.num_users) if wait_timeout is None else wait_timeout
    fl = DPFedAvgStrategy(server, config, wait_timeout=wait)
    fl.eval_data = data  # the test split: the result's accuracy (the final model, public)
    return fl, config


def check_spec(spec: dict[str, Any]) -> None:
    """Refuse a configuration the server would refuse, without a server: a client calls it
    before connecting, so a bad spec ends every process with the same message instead of
    leaving clients waiting."""
    _server_for(spec, 0.0)


def _result(fl_strategy: DPFedAvgStrategy, config: FedAvgConfig) -> dict[str, Any]:
    """The public result of a Flower run: ledger, user-level epsilon, clips, final parameters."""
    from dpclip.federated.server import evaluate

    server = fl_strategy.server
    eps = compute_epsilon(server.aggregator.ledger, config.delta, config.accountant).epsilon
    acc = loss = None
    data = getattr(fl_strategy, "eval_data", None)
    if data is not None:  # the released final model on the public test split
        server.load_into(server.model)
        acc, loss = evaluate(server.model, data.test.inputs, data.test.targets,
                             loss_fn=data.loss_fn(), ignore_index=data.ignore_index)
    return {"ledger": server.aggregator.ledger.to_dict(), "epsilon": eps,
            "test_accuracy": acc, "test_loss": loss,
            "clip_history": server.clip_history, "rounds": server.round_index,
            "theta": server.theta.tolist(),
            # NON-PRIVATE (opt-in): the failures reveal which rounds a failing user was sampled in
            **({"nonprivate/failures": fl_strategy.failures}
               if getattr(fl_strategy.config, "log_nonprivate", False) else {}),
            **server.describe()}


def run_server(spec: dict[str, Any], address: str, *, wait_timeout: float | None = None
               ) -> dict[str, Any]:
    """Run the Flower server for ``spec`` (legacy gRPC API); return the public result."""
    from flwr.server import ServerConfig, start_server

    fl_strategy, config = _server_for(spec, wait_timeout)
    with _quiet_flower():
        start_server(server_address=address, config=ServerConfig(num_rounds=config.rounds),
                     strategy=fl_strategy)
    return _result(fl_strategy, config)


# -- Flower's deployment engine: ServerApp / ClientApp ------------------------------------------

def _app_spec(context: Any, spec_path: str | None = None) -> dict[str, Any]:
    path = spec_path or context.run_config.get("spec")
    if not path:
        raise ValueError("the Flower App's run config needs `spec` (path of the run's JSON spec): "
                         "flwr run APP --run-config \"spec='run.json'\" (or "
                         "flower_apps(spec=...) for flwr.simulation.run_simulation)")
    with open(str(path)) as f:
        return json.load(f)


def _client_fn(context: Any, spec_path: str | None = None) -> Any:
    """The SuperNode's ClientApp: hosts the user named by the node config (``user=U``; under
    Flower's simulation engine its ``partition-id``)."""
    torch.set_num_threads(1)
    cfg = context.node_config
    if "user" not in cfg and "partition-id" not in cfg:
        raise ValueError("start each SuperNode with --node-config \"user=U\" (the user it hosts)")
    user = int(cfg["user"] if "user" in cfg else cfg["partition-id"])
    spec = _app_spec(context, spec_path)
    data = build_data(spec)
    model = build_model_for(spec, data)
    config_from_spec(spec)
    return UserClient(user, data.users[user], model, data.loss_fn()).to_client()


def flower_apps(spec: str | Path | None = None, out: str | Path | None = None
                ) -> tuple[Any, Any]:
    """``(ServerApp, ClientApp)`` of a run. ``spec``/``out`` (paths of the JSON spec and of the
    result file) default to the run config's ``spec``/``out`` (``flwr run``); give them for
    ``flwr.simulation.run_simulation``, which passes no run config."""
    server = flwr.server.ServerApp()

    @server.main()
    def _server_main(grid: Any, context: Any) -> None:
        """The same strategy, driven by ``start_grid``; writes the public result to ``out``."""
        from flwr.server import ServerConfig
        from flwr.server.compat import start_grid

        torch.set_num_threads(1)
        run = _app_spec(context, None if spec is None else str(spec))
        wait = float(context.run_config.get("wait-timeout", 0)) or None  # 0: scaled default
        fl_strategy, config = _server_for(run, wait)
        # (Flower's own log lines name the realised number of sampled users and of failures each
        # round: private under Poisson sampling, fifty-first hostile review; silenced as in
        # run_server and the clients)
        with _quiet_flower():
            start_grid(grid=grid, strategy=fl_strategy,
                       config=ServerConfig(num_rounds=config.rounds))
        target = out if out is not None else context.run_config.get("out")
        if target:
            with open(str(target), "w") as f:
                json.dump(_result(fl_strategy, config), f)

    client = flwr.client.ClientApp(
        client_fn=lambda context: _client_fn(context, None if spec is None else str(spec)))
    return server, client


#: the Flower App's components (spec and result paths from the run config)
server_app, client_app = flower_apps()

_APP_TOML = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "dpclip-fedavg"
version = "1.0.0"
description = "user-level DP-FedAvg (dpclip.federated.flower) as a Flower App"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "dpclip"

[tool.flwr.app.components]
serverapp = "dpclip_fedavg_app:server_app"
clientapp = "dpclip_fedavg_app:client_app"

[tool.flwr.app.config]
spec = {spec}
out = {out}
wait-timeout = {wait}
"""


def write_flower_app(directory: str | Path, spec_path: str | Path, out_path: str | Path = "",
                     wait_timeout: float = 0.0) -> Path:
    """Write a Flower App (``pyproject.toml`` + a module re-exporting :data:`server_app` and
    :data:`client_app`) for ``flwr run``; its run config names the JSON spec and the result file
    (``wait_timeout`` 0: the server waits 30 s plus 10 s per user for the clients).
    dpclip must be importable where the SuperLink and SuperNodes run the app."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "pyproject.toml").write_text(_APP_TOML.format(
        spec=json.dumps(str(Path(spec_path).resolve())),
        out=json.dumps(str(Path(out_path).resolve()) if out_path else ""),
        wait=float(wait_timeout)))
    (d / "dpclip_fedavg_app.py").write_text(
        '"""Flower App of dpclip user-level DP-FedAvg (written by write_flower_app)."""\n'
        "from dpclip.federated.flower import client_app, server_app\n\n"
        '__all__ = ["client_app", "server_app"]\n')
    return d


def run_client(spec: dict[str, Any], address: str, user: int) -> None:
    """Connect user ``user``'s client to the Flower server at ``address`` (insecure, localhost)."""
    from flwr.client import start_client

    # the server's checks (a refused spec ends the client, not a wait), and the users' data
    data = _server_for(spec, 0.0)[0].eval_data
    if not 0 <= user < data.num_users:
        raise ValueError(f"--user {user}: the run has users 0..{data.num_users - 1}")
    model = build_model_for(spec, data)
    with _quiet_flower():
        start_client(server_address=address,
                     client=UserClient(user, data.users[user], model, data.loss_fn()).to_client(),
                     insecure=True, max_retries=3, max_wait_time=30.0)


@contextlib.contextmanager
def _quiet_flower() -> Iterator[None]:
    """Flower's own log lines (its deprecation banners for start_server/start_client, per-round
    INFO) are not shown: dpclip prints its own line per round."""
    import logging

    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpclip.federated.flower")
    p.add_argument("role", choices=["server", "client"])
    p.add_argument("--address", required=True, help="host:port, e.g. 127.0.0.1:8089")
    p.add_argument("--spec", required=True, help="JSON file of the run (dpclip.federated.spec)")
    p.add_argument("--user", type=int, help="client: the user id this process hosts")
    p.add_argument("--out", help="server: write the result JSON here")
    p.add_argument("--wait-timeout", type=float, default=None,
                   help="server: seconds to wait for every client (default 30 + 10 per user)")
    args = p.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    try:
        return _main(args, spec, p)
    except (ValueError, OSError, RuntimeError) as exc:  # one line, no gRPC traceback
        print(f"dpclip fl {args.role}: error: {exc}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace, spec: dict[str, Any], p: argparse.ArgumentParser) -> int:
    if args.role == "server":
        result = run_server(spec, args.address, wait_timeout=args.wait_timeout)
        text = json.dumps(result)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        print(json.dumps({k: result[k] for k in ("epsilon", "rounds", "clip_history",
                                                  "test_accuracy")}))
        return 0
    if args.user is None:
        p.error("client needs --user")
    run_client(spec, args.address, args.user)
    return 0


if __name__ == "__main__":
    sys.exit(main())

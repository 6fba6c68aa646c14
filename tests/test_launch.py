"""`rollouts launch`: the Slurm script and Kubernetes manifests it writes for a cluster description.

The script is run by bash for real, with `srun`, `scontrol` and `curl` replaced by programs that
record their argv (the Slurm boundary: `make test-slurm` submits to a real controller); the
test then reads each node group's command lines from those records.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training.launch.cli import launch_main, write_launch_files
from training.launch.k8s_schema import validate_manifests
from training.recipes.cli import main as rollouts_main

ROOT = Path(__file__).resolve().parent.parent
RL_CONFIG = str(ROOT / "configs" / "rl_tiny.yaml")

CLUSTER = """\
name: rl-qwen
run_dir: {run_dir}
python: /venv/bin/python
env: {{NCCL_DEBUG: WARN}}
inference:
  nodes: 1
  engine: sglang
  gpus_per_node: 8
  tp: 2
  model: /models/qwen
trainer:
  nodes: 2
  gpus_per_node: 8
slurm:
  partition: gpu
  account: proj
  time: "04:00:00"
kubernetes:
  namespace: rl
  image: ghcr.io/me/rollouts:1
  run_dir_claim: shared-runs
"""

# A stand-in for a Slurm command: appends its name and argv to $FAKE_LOG as one JSON line.
FAKE = """\
import json, os, sys
name = os.path.basename(sys.argv[0])
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps([name, *sys.argv[1:]]) + "\\n")
if name == "scontrol" and sys.argv[1:3] == ["show", "hostnames"]:
    print("n0\\nn1\\nn2")
if name == "srun" and "torch.distributed.run" in sys.argv:
    sys.exit(int(os.environ.get("TRAINER_RC", "0")))
"""


@pytest.fixture
def launched(tmp_path: Path) -> tuple[Path, Path, Path]:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER.format(run_dir=tmp_path / "run"))
    job, k8s = write_launch_files(RL_CONFIG, str(cluster), None, ["rollout.batch_size=4"])
    return cluster, job, k8s


def run_script(job: Path, tmp_path: Path, **env: str) -> tuple[int, list[list[str]]]:
    """Run the batch script as Slurm would on the first node; the Slurm commands it called."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    for name in ("srun", "scontrol", "curl"):
        (fake_bin / name).write_text(f"#!{sys.executable}\n{FAKE}")
        (fake_bin / name).chmod(0o755)
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    job_env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_LOG": str(log),
               "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[0-2]", **env}  # fmt: skip
    text = job.read_text().replace(f"cd {shlex.quote(os.getcwd())}", "cd .")
    done = subprocess.run(["bash", "-c", text], env=job_env, cwd=ROOT, timeout=60,
                          capture_output=True, text=True)  # fmt: skip
    return done.returncode, [json.loads(line) for line in log.read_text().splitlines()]


def engine_argv(call: list[str]) -> list[str]:
    """The server command of an engine step: what follows the restart loop's `engine` $0."""
    return call[call.index("engine") + 1 :]


def test_slurm_script_starts_each_servers_on_the_inference_node_then_torchrun_given_their_urls(
    launched, tmp_path
):
    _, job, _ = launched
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0
    sbatch = [
        line.split()[1] for line in job.read_text().splitlines() if line.startswith("#SBATCH")
    ]
    assert {"--nodes=3", "--gpus-per-node=8", "--partition=gpu", "--account=proj",
            "--time=04:00:00", "--requeue"} <= set(sbatch)  # fmt: skip

    rc, calls = run_script(job, tmp_path)
    assert rc == 0
    sruns = [c for c in calls if c[0] == "srun"]
    engines = [c for c in sruns if "sglang.launch_server" in c]
    trainers = [c for c in sruns if "torch.distributed.run" in c]
    assert len(engines) == 4 and len(trainers) == 1 and len(sruns) == 5  # 8 GPUs / TP 2
    for i, call in enumerate(sorted(engines, key=lambda c: int(c[c.index("--port") + 1]))):
        assert "--nodelist=n0" in call and "--nodes=1" in call
        argv = engine_argv(call)
        assert argv[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
        flags = dict(zip(argv[3::2], argv[4::2], strict=True))
        assert flags == {"--model-path": "/models/qwen", "--host": "0.0.0.0",
                         "--port": str(30000 + i), "--tp-size": "2", "--dp-size": "1",
                         "--base-gpu-id": str(2 * i), "--weight-version": "0",
                         "--max-running-requests": "128"}  # fmt: skip
    trainer = trainers[0]
    assert "--nodes=2" in trainer and "--nodelist=n1,n2" in trainer
    torchrun = trainer[trainer.index("/venv/bin/python") :]
    assert torchrun[1:8] == ["-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=8",
                             "--rdzv-backend=c10d", "--rdzv-endpoint=n1:29500", "--rdzv-id=7"]  # fmt: skip
    urls = [torchrun[i + 1] for i, word in enumerate(torchrun) if word == "--engine-url"]
    assert urls == [f"http://n0:{30000 + i}" for i in range(4)]
    assert torchrun[8:16] == ["examples/run_rl.py", "--config", RL_CONFIG, "--output-dir",
                              str(tmp_path / "run"), "--resume", "--model", "/models/qwen"]  # fmt: skip
    assert torchrun[-1] == "rollout.batch_size=4" and "--router-url" not in torchrun
    health = [c[-1] for c in calls if c[0] == "curl"]
    assert health == [f"{u}/health_generate" for u in urls]  # each engine before the trainer
    assert calls.index(trainer) > max(calls.index(c) for c in calls if c[0] == "curl")
    assert (tmp_path / "run/logs/job-7/attempt-0").is_dir()


@pytest.mark.parametrize(("trainer_rc", "attempt", "requeued"),
                         [(1, "0", True), (1, "2", False), (2, "0", False), (0, "0", False)])  # fmt: skip
def test_a_failed_trainer_requeues_the_job_until_max_attempts_and_logs_per_attempt(
    launched, tmp_path, trainer_rc, attempt, requeued
):
    _, job, _ = launched
    rc, calls = run_script(job, tmp_path, TRAINER_RC=str(trainer_rc), SLURM_RESTART_COUNT=attempt)
    assert rc == trainer_rc
    assert (["scontrol", "requeue", "7"] in calls) is requeued  # max_attempts 3: attempts 0..2
    assert (tmp_path / f"run/logs/job-7/attempt-{attempt}").is_dir()


@pytest.mark.parametrize(("overrides", "flags"), [
    (["model.lora.rank=8", "engines.admin_api_key=sekret"],
     ["--admin-api-key", "sekret", "--enable-lora", "--max-lora-rank", "8",
      "--lora-target-modules", "all", "--max-loras-per-batch", "3"]),
    (["engines.colocate=true", "engines.max_running_requests=32"],
     ["--enable-memory-saver"]),
])  # fmt: skip
def test_engines_get_the_server_flags_the_rl_config_implies(tmp_path, overrides, flags):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER.format(run_dir=tmp_path / "run"))
    job, k8s = write_launch_files(RL_CONFIG, str(cluster), None, overrides)
    _, calls = run_script(job, tmp_path)
    slots = "32" if "engines.max_running_requests=32" in overrides else "128"
    server = engine_argv(next(c for c in calls if "sglang.launch_server" in c))
    assert server[server.index("--weight-version") + 2 :] == [
        "--max-running-requests",
        slots,
        *flags,
    ]
    trainer = next(c for c in calls if "torch.distributed.run" in c)
    assert trainer[-2:] == overrides  # the trainer reads the same config
    engine_set = list(yaml.safe_load_all(k8s.read_text()))[1]
    assert (
        shlex.join(flags) in engine_set["spec"]["template"]["spec"]["containers"][0]["command"][2]
    )


def test_the_gateway_fronts_every_engine_and_the_trainer_generates_through_it(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    text = CLUSTER.format(run_dir=tmp_path / "run").replace("tp: 2", "tp: 4\n  gateway: true")
    cluster.write_text(text)
    job, k8s = write_launch_files(RL_CONFIG, str(cluster), None)
    _, calls = run_script(job, tmp_path)
    gateway = next(c for c in calls if "sglang_router.launch_router" in c)
    workers = gateway[gateway.index("--worker-urls") + 1 : gateway.index("--host")]
    assert workers == ["http://n0:30000", "http://n0:30001"]
    trainer = next(c for c in calls if "torch.distributed.run" in c)
    assert trainer[trainer.index("--router-url") + 1] == "http://n0:30080"
    assert validate_manifests(yaml.safe_load_all(k8s.read_text())) == []


def test_k8s_manifests_load_as_yaml_and_pass_the_schema_check(launched):
    _, _, k8s = launched
    docs = list(yaml.safe_load_all(k8s.read_text()))
    assert validate_manifests(docs) == []
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert kinds == {(k, f"rl-qwen-{r}") for k in ("Service", "StatefulSet")
                     for r in ("engine", "trainer")}  # fmt: skip
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    engine, trainer = sets["rl-qwen-engine"]["spec"], sets["rl-qwen-trainer"]["spec"]
    assert (engine["replicas"], trainer["replicas"]) == (1, 2)
    container = trainer["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert container["volumeMounts"][0]["mountPath"].endswith("/run")
    argv = shlex.split(container["command"][2].splitlines()[-1])[1:]  # after `exec`
    urls = [argv[i + 1] for i, word in enumerate(argv) if word == "--engine-url"]
    assert urls == [f"http://rl-qwen-engine-0.rl-qwen-engine.rl.svc:{30000 + i}" for i in range(4)]
    assert "--rdzv-endpoint=rl-qwen-trainer-0.rl-qwen-trainer.rl.svc:29500" in argv
    assert "--nnodes=2" in argv
    script = engine["template"]["spec"]["containers"][0]["command"][2]
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0


def test_the_schema_check_names_each_broken_field(launched):
    _, _, k8s = launched
    docs = list(yaml.safe_load_all(k8s.read_text()))
    docs[0]["spec"].pop("clusterIP")  # the engine Service no longer headless
    docs[1]["spec"]["template"]["metadata"]["labels"] = {"x": "y"}
    container = docs[3]["spec"]["template"]["spec"]["containers"][0]
    container["env"].append({"name": "A"})
    container["volumeMounts"][0]["name"] = "other"
    docs[2]["metadata"]["name"] = "Trainer_Service"
    docs[3]["apiVersion"] = "v1"
    problems = validate_manifests(docs)
    assert len(problems) == 4, problems  # docs[3]'s wrong apiVersion hides its other fields
    joined = "\n".join(problems)
    assert "doc 1 (StatefulSet/rl-qwen-engine): spec.template.metadata.labels" in joined
    assert "doc 2 (Service/Trainer_Service): metadata.name: not a DNS-1123 label" in joined
    assert "doc 3 (StatefulSet/rl-qwen-trainer): apiVersion: StatefulSet is apps/v1" in joined
    assert "must be headless (clusterIP: None)" in joined
    docs[3]["apiVersion"] = "apps/v1"
    joined = "\n".join(validate_manifests(docs))
    assert (
        f"containers[0].env[{len(container['env']) - 1}]: give exactly one of value and valueFrom"
        in joined
    )
    assert "containers[0].volumeMounts[0]: names no volume of the pod" in joined


@pytest.mark.parametrize(("edit", "line", "key", "says"), [
    (("  tp: 2", "  tpp: 2"), 9, "inference.tpp", "unknown key 'inference.tpp'; did you mean 'inference.tp'?"),
    (("  tp: 2", "  tp: 3"), 9, "inference.tp", "tp x dp = 3 x 1 does not divide gpus_per_node = 8"),
    (("  nodes: 2\n", "  nodes: 0\n"), 12, "trainer.nodes", "greater than or equal to 1"),
    (("slurm:", "slurm:\n  queue: a"), 15, "slurm.queue", "unknown key 'slurm.queue'"),
])  # fmt: skip
def test_a_bad_cluster_description_is_refused_naming_file_line_and_key(
    tmp_path, capsys, edit, line, key, says
):
    text = CLUSTER.format(run_dir=tmp_path / "run").replace(*edit)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(text)
    assert launch_main(["--config", RL_CONFIG, "--cluster", str(cluster)]) == 2
    err = capsys.readouterr().err
    assert f"{cluster}:{line}: " in err and key in err and says in err, err
    assert not (tmp_path / "run").exists()  # nothing written


def test_rollouts_launch_writes_the_files_and_a_relative_run_dir_is_refused(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER.format(run_dir=tmp_path / "run"))
    out = tmp_path / "out"
    argv = ["launch", "--config", RL_CONFIG, "--cluster", str(cluster), "--out", str(out)]
    assert rollouts_main(argv) == 0
    assert f"wrote {out / 'job.sbatch'}" in capsys.readouterr().out
    assert (out / "k8s.yaml").is_file() and os.access(out / "job.sbatch", os.X_OK)
    cluster.write_text(CLUSTER.format(run_dir="runs/x"))
    assert rollouts_main(argv) == 2
    err = capsys.readouterr().err
    assert f"{cluster}:2: run_dir: 'runs/x' is relative" in err


def test_docs_show_the_script_and_manifests_rollouts_launch_writes(tmp_path):
    from training.config import load_config
    from training.launch.k8s import dump_manifests, render_manifests
    from training.launch.slurm import config_engine_args, render_sbatch
    from training.launch.spec import load_cluster
    from training.rl_config import RLRunConfig

    text = (ROOT / "docs" / "cluster.md").read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(next(body for lang, body in blocks if lang == "yml"))
    spec = load_cluster(cluster)
    rl_config, model = "/shared/rollouts/configs/rl_qwen_gsm8k.yaml", spec.inference.model
    args = config_engine_args(
        load_config(RLRunConfig, ROOT / "configs/rl_qwen_gsm8k.yaml"), "sglang"
    )
    script = render_sbatch(spec, rl_config=rl_config, model=model, workdir=spec.workdir,
                           config_args=args)  # fmt: skip
    manifests = render_manifests(spec, rl_config=rl_config, model=model, config_args=args)
    assert ("sh", script) in blocks  # rerun the page's generation when the launcher changes
    assert ("yml", dump_manifests(manifests)) in blocks
    assert validate_manifests(manifests) == []

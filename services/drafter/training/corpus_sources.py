"""Where training and held-out prompts come from, and the build of each set (`treeserve make-prompts`).

Every source is something this project can install from its package registries (Python's standard library and
installed packages, Debian packages' headers, modules, scripts and manual pages, npm packages), with its licence,
which goes into every prompt made from it. A source missing on a machine is skipped with a line saying how to
install it, so a build works where fewer sources exist.

Held-out sets are drawn from whole sources that the training set never reads (the `split` of each source), so
held-out figures measure generalisation. The training build also drops any snippet whose lines mostly appear in
a held-out source (a vendored or copied file), and any snippet it already has.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from treeserve.drafter.training.chat_topics import topic_prompts, words_of
from treeserve.drafter.training.corpus import CODE_LANGUAGES, PROSE_STYLES, Document, distinctive_lines, document_prompts
from treeserve.errors import TreeserveError
from treeserve.prompt_sets import WORKLOADS, read_prompts, write_prompts

TRAIN, HELD_OUT_CODE, HELD_OUT_PROSE = "train", "held-out-code", "held-out-prose"
HELD_OUT_EARLIER = "held-out-earlier"  # the sources of treeserve/prompts/held-out-code.jsonl: never trained on
SKIPPED_FOLDERS = {"__pycache__", "node_modules", "site-packages", "dist-packages", "_vendor", "vendor", "vendored"}
MAX_FILE_BYTES = 1 << 20
NPM_FOLDERS = (Path("corpus/sources/npm/node_modules"), Path("/usr/lib/node_modules"))
NPM_PREFIX = "corpus/sources/npm"
PYPI_FOLDER = Path("corpus/sources/pypi")  # source distributions unpacked there (their docs are not in wheels)
DEBIAN_PYTHON = Path("/usr/lib/python3/dist-packages")


class Missing(Exception):
    """A source that is not on this machine; the message says how to get it."""


# ------------------------------------------------------------------------------------------ finding files


def excluded(relative: Path, patterns: tuple[str, ...] | list[str]) -> bool:
    """A pattern matches the path relative to its folder, or any one folder or file name on it."""
    text = relative.as_posix()
    return any(fnmatch.fnmatch(text, p) or any(fnmatch.fnmatch(part, p) for part in relative.parts)
               for p in patterns)


def walk(root: Path, include: tuple[str, ...], exclude: tuple[str, ...]) -> list[tuple[Path, str]]:
    """(path, path relative to root) of the files under `root` whose name matches an `include` glob, sorted;
    hidden folders, caches, installed and vendored packages are not entered."""
    files = []
    for folder, subfolders, names in os.walk(root):
        here = Path(folder)
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and d not in SKIPPED_FOLDERS
                               and not excluded((here / d).relative_to(root), exclude))
        for name in names:
            path = here / name
            relative = path.relative_to(root)
            if any(fnmatch.fnmatch(name, g) for g in include) and not excluded(relative, exclude) \
                    and path.is_file() and path.stat().st_size <= MAX_FILE_BYTES:
                files.append((path, relative.as_posix()))
    return sorted(files, key=lambda item: item[1])


def python_site_folders() -> list[Path]:
    """Where installed Python packages live: this interpreter's (the venv's), its base interpreter's, Debian's."""
    base = sysconfig.get_path("purelib", vars={"base": sys.base_prefix, "platbase": sys.base_prefix})
    folders = [Path(p) for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    return list(dict.fromkeys(folders + [Path(base), DEBIAN_PYTHON]))


def distribution_version(site: Path, name: str) -> str:
    """The version of distribution `name` in a site folder, from its .dist-info folder's name ("?" if none)."""
    wanted = name.lower().replace("-", "_")
    for info in site.glob("*.dist-info"):
        found, _, version = info.name.removesuffix(".dist-info").rpartition("-")
        if found.lower().replace("-", "_").replace(".", "_") == wanted:
            return version
    return "?"


CODE_GLOBS = tuple(f"*{suffix}" for suffix in CODE_LANGUAGES)
DOC_GLOBS = tuple(f"*{suffix}" for suffix in PROSE_STYLES)


@dataclass(frozen=True)
class Folder:
    """Code and docs under a folder (a --from folder, or a test's); the other locators describe where they found
    their files without this machine's paths, since held-out summaries are kept in the repository."""
    path: Path
    include: tuple[str, ...] = CODE_GLOBS + DOC_GLOBS
    exclude: tuple[str, ...] = ()

    def files(self) -> tuple[str, list[tuple[Path, str]]]:
        if not self.path.is_dir():
            raise Missing(f"{self.path} is not a folder")
        return str(self.path), walk(self.path, self.include, self.exclude)


@dataclass(frozen=True)
class PythonStdlib:
    """The .py files of this interpreter's standard library, or of one folder of it."""
    under: str = ""
    exclude: tuple[str, ...] = ()

    def files(self):
        root = Path(sysconfig.get_paths()["stdlib"]) / self.under
        if not root.is_dir():
            raise Missing(f"{root} is not a folder")
        return f"Python {platform.python_version()} standard library {self.under}".strip(), \
            walk(root, ("*.py",), self.exclude)


@dataclass(frozen=True)
class PythonPackage:
    """An installed package's .py files, found in the first site folder that has it."""
    name: str  # dotted import name
    pip: str   # its distribution's name, for the install hint
    exclude: tuple[str, ...] = ()

    def files(self):
        for site in python_site_folders():
            root = site.joinpath(*self.name.split("."))
            if root.is_dir():
                return f"Python package {self.pip} {distribution_version(site, self.pip)}", \
                    walk(root, ("*.py",), self.exclude)
        raise Missing(f"Python package {self.name} is not installed (pip install {self.pip})")


@dataclass(frozen=True)
class DebianPackage:
    """The files an installed Debian package put on the machine (`dpkg-query -L`) that match `include`, globs on
    the absolute path; labelled by their path below the folder that holds them all."""
    package: str
    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()

    def files(self):
        try:
            listed = subprocess.run(["dpkg-query", "-L", self.package], capture_output=True, text=True, check=False)
        except FileNotFoundError:
            raise Missing("dpkg-query not found (not a Debian system)") from None
        if listed.returncode != 0:
            raise Missing(f"Debian package {self.package} is not installed (apt-get install {self.package})")
        paths = sorted({Path(line) for line in listed.stdout.splitlines()
                        if any(fnmatch.fnmatch(line, g) for g in self.include)})
        paths = [p for p in paths if p.is_file() and not p.is_symlink() and p.stat().st_size <= MAX_FILE_BYTES]
        if not paths:
            raise Missing(f"Debian package {self.package} has no files matching {', '.join(self.include)}")
        root = Path(os.path.commonpath([p.parent for p in paths]))
        found = [(p, p.relative_to(root).as_posix()) for p in paths]
        version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", self.package], capture_output=True,
                                 text=True, check=False).stdout
        return f"Debian package {self.package} {version}", \
            [(p, r) for p, r in found if not excluded(Path(r), self.exclude)]


@dataclass(frozen=True)
class NpmPackage:
    """Files of an npm package installed under NPM_PREFIX (`npm install --prefix`), or npm's global folder."""
    name: str
    version: str
    include: tuple[str, ...] = ("*.js", "*.mjs")
    exclude: tuple[str, ...] = ("dist", "build", "*.min.js", "test", "tests")
    under: tuple[str, ...] = ("lib",)  # folders of the package to read

    def files(self):
        for root in NPM_FOLDERS:
            package = root / self.name
            if (package / "package.json").is_file():
                version = json.loads((package / "package.json").read_text()).get("version", "?")
                found = [(path, relative if under == "." else f"{under}/{relative}")
                         for under in self.under if (package / under).is_dir()
                         for path, relative in walk(package / under, self.include, self.exclude)]
                return f"npm package {self.name}@{version}", found
        raise Missing(f"npm package {self.name} is not installed "
                      f"(npm install --prefix {NPM_PREFIX} {self.name}@{self.version})")


@dataclass(frozen=True)
class PypiSdist:
    """A folder (docs) of a PyPI source distribution unpacked under PYPI_FOLDER."""
    name: str
    version: str
    under: str
    include: tuple[str, ...] = ("*.rst", "*.txt")
    exclude: tuple[str, ...] = ()

    def files(self):
        root = PYPI_FOLDER / f"{self.name}-{self.version}" / self.under
        if not root.is_dir():
            raise Missing(f"{root} not found (pip download --no-binary :all: --no-deps --no-build-isolation "
                          f"--dest {PYPI_FOLDER} {self.name}=={self.version}, then unpack it there)")
        return f"PyPI source distribution {self.name}=={self.version}, {self.under}/", \
            walk(root, self.include, self.exclude)


# ------------------------------------------------------------------------------------------ the sources


@dataclass(frozen=True)
class Source:
    name: str      # the first part of each prompt's "source"
    split: str     # TRAIN, HELD_OUT_CODE, HELD_OUT_PROSE or HELD_OUT_EARLIER
    where: object  # a locator above: .files() -> (where, [(path, label)])
    licence: str
    language: str | None = None  # the files' language where their suffix does not say it
    man: bool = False            # manual pages, rendered to plain text with groff
    limit: int | None = None     # prompts kept at most: a big package would crowd out the rest
    style: str | None = None     # prose whatever the suffix, with headings written this way (corpus.Document)
    topics: bool = False         # WordNet's database: open chat prompts about its words (chat_topics)


def pkg(name: str, licence: str, pip: str | None = None, limit: int | None = None, split: str = TRAIN,
        exclude: tuple[str, ...] = ()) -> Source:
    return Source(name, split, PythonPackage(name, pip or name, exclude), licence, limit=limit)


def man(package: str, licence: str, include: tuple[str, ...] = ("/usr/share/man/man*",), split: str = TRAIN,
        limit: int | None = None, name: str | None = None) -> Source:
    return Source(name or f"man-{package}", split, DebianPackage(package, include), licence, man=True, limit=limit)


def npm(name: str, version: str, split: str = TRAIN, licence: str = "MIT", limit: int | None = None,
        **where) -> Source:
    return Source(f"npm-{name}", split, NpmPackage(name, version, **where), licence, limit=limit)


MAN_PAGES_LICENCE = "Linux man-pages licences (mostly Linux-man-pages-copyleft, GPL-2.0-or-later, BSD), per page"
PERL_LICENCE = "Artistic-1.0-Perl OR GPL-1.0-or-later"
PYTHON_DOCS = ("/usr/share/doc/python3.11/html/_sources/*.rst.txt",)
HELD_OUT_DOCS = ("howto/*", "faq/*")  # folders of the Python docs kept for the held-out prose
EARLIER_DOCS = ("library/asyncio*", "library/email*")  # the docs of the first held-out set's modules

SOURCES = (
    # Python: the standard library and installed packages.
    Source("python-stdlib", TRAIN, PythonStdlib(exclude=("test", "asyncio", "email", "idlelib")), "PSF-2.0"),
    Source("python-stdlib-tests", TRAIN, PythonStdlib("test", exclude=("test_asyncio", "test_email")), "PSF-2.0",
           limit=3000),
    pkg("torch", "BSD-3-Clause", limit=8000),
    pkg("transformers", "Apache-2.0", limit=5000),
    pkg("sympy", "BSD-3-Clause", limit=3500),
    pkg("numpy", "BSD-3-Clause", limit=3000),
    pkg("scipy", "BSD-3-Clause", limit=3000),
    pkg("networkx", "BSD-3-Clause", limit=2000),
    pkg("matplotlib", "Matplotlib licence (PSF-2.0-style)", limit=2500),
    pkg("pygments", "BSD-2-Clause", limit=1500),
    pkg("fontTools", "MIT", pip="fonttools", limit=1500),
    pkg("huggingface_hub", "Apache-2.0", limit=2000),
    pkg("pydantic", "MIT", limit=2000),
    pkg("rich", "MIT"),
    pkg("setuptools", "MIT"),
    pkg("pip", "MIT"),
    pkg("_pytest", "MIT", pip="pytest"),
    pkg("grpc", "Apache-2.0", pip="grpcio"),
    pkg("google.protobuf", "BSD-3-Clause", pip="protobuf"),
    pkg("opentelemetry", "Apache-2.0", pip="opentelemetry-sdk"),
    pkg("mpmath", "BSD-3-Clause"),
    pkg("fsspec", "BSD-3-Clause"),
    pkg("anyio", "MIT"),
    pkg("urllib3", "MIT"),
    pkg("tqdm", "MPL-2.0 AND MIT"),
    pkg("packaging", "Apache-2.0 OR BSD-2-Clause"),
    pkg("pyparsing", "MIT"),
    pkg("markdown_it", "MIT", pip="markdown-it-py"),
    pkg("flask", "BSD-3-Clause"),
    pkg("werkzeug", "BSD-3-Clause"),
    pkg("docutils", "public domain, BSD-2-Clause, PSF-2.0 or GPL-3.0-or-later, per file"),
    pkg("hypothesis", "MPL-2.0"),
    pkg("IPython", "BSD-3-Clause", pip="ipython", limit=1500),
    pkg("prompt_toolkit", "BSD-3-Clause", pip="prompt-toolkit"),
    pkg("trio", "MIT OR Apache-2.0"),
    pkg("jedi", "MIT"),
    pkg("parso", "MIT"),
    pkg("libcst", "MIT", limit=1500),
    pkg("cryptography", "Apache-2.0 OR BSD-3-Clause"),
    pkg("jsonschema", "MIT"),
    pkg("attr", "MIT", pip="attrs"),
    # C and C++ headers, Perl modules, shell, CMake and JavaScript.
    Source("c-glibc", TRAIN, DebianPackage("libc6-dev", ("/usr/include/*.h",)), "LGPL-2.1-or-later"),
    Source("c-linux", TRAIN, DebianPackage("linux-libc-dev", ("/usr/include/*.h",)),
           "GPL-2.0-only WITH Linux-syscall-note", limit=2500),
    Source("c-openssl", TRAIN, DebianPackage("libssl-dev", ("/usr/include/*.h",)), "Apache-2.0"),
    Source("c-python", TRAIN, DebianPackage("libpython3.11-dev", ("/usr/include/*.h",)), "PSF-2.0"),
    Source("c-sqlite", TRAIN, DebianPackage("libsqlite3-dev", ("/usr/include/*.h",)), "blessing (public domain)"),
    Source("cpp-libstdc++", TRAIN, DebianPackage("libstdc++-12-dev", ("/usr/include/c++/*",)),
           "GPL-3.0-or-later WITH GCC-exception-3.1", language="cpp", limit=2500),
    Source("perl-core", TRAIN, DebianPackage("perl-modules-5.36", ("/usr/share/perl/*.pm", "/usr/share/perl/*.pl"),
                                             exclude=("unicore",)), PERL_LICENCE, limit=3500),
    Source("bash-completion", TRAIN, DebianPackage("bash-completion", ("/usr/share/bash-completion/completions/*",)),
           "GPL-2.0-or-later", language="bash"),
    Source("cmake-modules", TRAIN, DebianPackage("cmake-data", ("/usr/share/cmake-*/Modules/*.cmake",)),
           "BSD-3-Clause", limit=2000),
    npm("eslint", "10.15.0"),
    npm("webpack", "5.113.0", limit=3000),
    npm("lodash", "4.18.1", under=(".",), exclude=("lodash.js", "*.min.js")),
    npm("three", "0.187.0", under=("src", "examples/jsm"), exclude=("libs", "*.min.js"), limit=3000),
    npm("npm", "11.19.1", licence="Artistic-2.0", exclude=()),
    # Documentation: the Python docs, manual pages, books.
    Source("python-docs", TRAIN, DebianPackage("python3.11-doc", PYTHON_DOCS, HELD_OUT_DOCS + EARLIER_DOCS),
           "PSF-2.0", style="rst"),
    Source("cmake-docs", TRAIN, DebianPackage("cmake-data", ("/usr/share/cmake-*/Help/*.rst",)), "BSD-3-Clause"),
    Source("debian-reference", TRAIN, DebianPackage("debian-reference-en", ("*.txt.gz",)), "GPL-2.0-or-later",
           style="indented"),
    Source("django-docs", TRAIN, PypiSdist("django", "5.2.19", "docs", ("*.txt",), ("_theme", "requirements.txt")),
           "BSD-3-Clause", style="rst", limit=8000),
    Source("sqlalchemy-docs", TRAIN, PypiSdist("sqlalchemy", "2.1.9", "doc/build", ("*.rst",), ("changelog",)),
           "MIT", style="rst"),
    Source("sphinx-docs", TRAIN, PypiSdist("sphinx", "9.0.4", "doc", ("*.rst",), ("changes",)), "BSD-2-Clause",
           style="rst"),
    man("manpages", MAN_PAGES_LICENCE),
    man("manpages-dev", MAN_PAGES_LICENCE),
    man("libssl-doc", "Apache-2.0"),
    man("openssl", "Apache-2.0"),
    man("perl-doc", PERL_LICENCE, limit=6000),
    man("tcl8.6-doc", "TCL"),
    man("coreutils", "GPL-3.0-or-later"),
    man("util-linux", "GPL-2.0-or-later, per file"),
    man("systemd", "LGPL-2.1-or-later"),
    man("iproute2", "GPL-2.0-or-later"),
    man("procps", "GPL-2.0-or-later"),
    man("apt", "GPL-2.0-or-later"),
    man("dpkg", "GPL-2.0-or-later"),
    man("bash", "GPL-3.0-or-later"),
    man("openssh-client", "BSD-2-Clause and other BSD-style licences"),
    # Open chat: questions and writing tasks about everyday words.
    Source("wordnet-chat", TRAIN, DebianPackage("wordnet-base", ("/usr/share/wordnet/data.*",
                                                                 "/usr/share/wordnet/index.*")),
           "WordNet-3.0", topics=True),
    # Held out for code: whole packages, in five languages.
    pkg("requests", "Apache-2.0", split=HELD_OUT_CODE),
    pkg("click", "BSD-3-Clause", split=HELD_OUT_CODE),
    Source("c-libxml2", HELD_OUT_CODE, DebianPackage("libxml2-dev", ("/usr/include/*.h",)), "MIT"),
    Source("perl-dpkg", HELD_OUT_CODE, DebianPackage("libdpkg-perl", ("/usr/share/perl5/*.pm",)), "GPL-2.0-or-later"),
    Source("bash-examples", HELD_OUT_CODE, DebianPackage("bash-doc", ("/usr/share/doc/bash/examples/*",),
                                                         ("*.tar.*", "*.png", "*.txt", "*.in", "*.md", "README",
                                                          "LICENSE", "Makefile*")),
           "GPL-3.0-or-later (bash; some examples carry their own notices)", language="bash"),
    npm("express", "5.3.0", split=HELD_OUT_CODE),
    npm("axios", "1.21.1", split=HELD_OUT_CODE),
    # Held out for prose: git's manual pages, npm's docs, two folders of the Python docs.
    man("git-man", "GPL-2.0-only", split=HELD_OUT_PROSE),
    Source("npm-docs", HELD_OUT_PROSE, NpmPackage("npm", "11.19.1", ("*.md",), (), ("docs/content",)),
           "Artistic-2.0"),
    Source("python-docs-howto-faq", HELD_OUT_PROSE,
           DebianPackage("python3.11-doc", tuple(p.replace("*.rst.txt", f"{d}.rst.txt")
                                                 for p in PYTHON_DOCS for d in HELD_OUT_DOCS)),
           "PSF-2.0", style="rst"),
    # Held out by the first held-out set (treeserve/prompts/held-out-code.jsonl): never trained on, not drawn again.
    Source("python-asyncio", HELD_OUT_EARLIER, PythonStdlib("asyncio"), "PSF-2.0"),
    Source("python-email", HELD_OUT_EARLIER, PythonStdlib("email"), "PSF-2.0"),
    pkg("jinja2", "BSD-3-Clause", split=HELD_OUT_EARLIER),
    pkg("markupsafe", "BSD-3-Clause", split=HELD_OUT_EARLIER),
)

# The sets one command builds: which split, how many prompts at most, and the held-out file names.
PRESETS = {"training": (TRAIN, 200_000), HELD_OUT_CODE: (HELD_OUT_CODE, 256), HELD_OUT_PROSE: (HELD_OUT_PROSE, 256)}
HELD_OUT_FILES = {HELD_OUT_CODE: "held-out-code-wide.jsonl", HELD_OUT_PROSE: "held-out-prose.jsonl"}


# ------------------------------------------------------------------------------------------ reading documents


def render_man(path: Path) -> str | None:
    """A manual page as plain text, 78 columns, left-adjusted and unhyphenated (passages read as prose); None for
    a page that only includes another (`.so`)."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if raw.lstrip().startswith(b".so "):
        return None
    prelude = b".am TH\n.ad l\n..\n.am SH\n.ad l\n..\n"
    rendered = subprocess.run(["groff", "-t", "-Tutf8", "-mandoc", "-P-cbou", "-rLL=78n", "-rHY=0"],
                              input=prelude + raw, capture_output=True, timeout=60, check=False,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"})
    lines = rendered.stdout.decode("utf-8", "replace").splitlines()
    return "\n".join(lines[1:-1]) if len(lines) > 2 else None  # without the page's header and footer lines


def read_document(source: Source, path: Path, label: str) -> Document | None:
    try:
        if source.man:
            text = render_man(path)
        else:
            raw = path.read_bytes()
            text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile, subprocess.TimeoutExpired):
        return None
    if not text or "\0" in text:
        return None
    suffix = Path(path.name.removesuffix(".gz")).suffix
    if source.language:
        return Document(label, text, source.language)
    if source.man:  # rendered: unindented headings over indented text
        return Document(label, text, None, "indented")
    if source.style or suffix in PROSE_STYLES:
        return Document(label, text, None, source.style or PROSE_STYLES[suffix])
    return Document(label, text, CODE_LANGUAGES[suffix]) if suffix in CODE_LANGUAGES else None


def source_documents(source: Source) -> tuple[str, list[Document]]:
    """Where the source is, and its documents in label order (manual pages rendered on two threads)."""
    where, files = source.where.files()
    labelled = [(path, f"{source.name}/{label}") for path, label in files]
    with ThreadPoolExecutor(2 if source.man else 1) as pool:
        documents = pool.map(lambda item: read_document(source, *item), labelled)
        return where, [d for d in documents if d is not None]


# ------------------------------------------------------------------------------------------ building a set


@dataclass
class Build:
    """What a build took from each source, for its summary."""
    prompts: list[dict] = field(default_factory=list)
    sources: dict = field(default_factory=dict)  # name -> {"prompts", "files", "licence", "where", ...}
    skipped: dict = field(default_factory=dict)  # name -> why


def held_out_lines(sources: list[Source], log) -> set[str]:
    """Every distinctive line of every held-out source present: training keeps no snippet made mostly of them."""
    lines = set()
    for source in sources:
        if source.split == TRAIN:
            continue
        try:
            _, documents = source_documents(source)
        except Missing:
            continue
        for doc in documents:
            lines.update(distinctive_lines(doc.text))
    print(f"make-prompts: {len(lines)} distinctive lines of held-out sources kept out of training", file=log)
    return lines


def mostly_held_out(snippet: str, held: set[str]) -> bool:
    lines = distinctive_lines(snippet)
    return bool(lines) and 2 * sum(line in held for line in lines) >= len(lines)


def source_snippets(source: Source, seed: int, per_file: int) -> tuple[str, int, list[tuple[dict, str]]]:
    """Where the source is, how many files it read, and its (record, snippet) pairs. A topics source's snippet is
    its prompt, and its topics leave out the words of the held-out chat prompts."""
    if source.topics:
        where, files = source.where.files()
        avoid = words_of(record["prompt"] for record in read_prompts(WORKLOADS["chat"]))
        return where, len(files), topic_prompts(files[0][0].parent, seed, avoid)
    where, documents = source_documents(source)
    return where, len(documents), [pair for doc in documents for pair in document_prompts(doc, seed, per_file)]


def take_source(source: Source, seed: int, per_file: int, seen: set, held: set[str], build: Build, log) -> list[dict]:
    """The source's prompts (licence added): new snippets only, none mostly from held-out text, at most its limit."""
    started = time.monotonic()
    try:
        where, files, snippets = source_snippets(source, seed, per_file)
    except Missing as why:
        build.skipped[source.name] = str(why)
        print(f"make-prompts: skipped {source.name}: {why}", file=log)
        return []
    kept, repeated, held_back = [], 0, 0
    for record, snippet in snippets:
        key = hashlib.blake2b(snippet.strip().encode(), digest_size=16).digest()
        if key in seen:
            repeated += 1
        elif held and mostly_held_out(snippet, held):
            held_back += 1
        else:
            seen.add(key)
            kept.append({**record, "licence": source.licence})
    if source.limit is not None and len(kept) > source.limit:
        kept = random.Random(f"{seed}:{source.name}").sample(kept, source.limit)
    build.sources[source.name] = {"prompts": len(kept), "files": files, "licence": source.licence,
                                  "where": where, "repeated_snippets": repeated, "mostly_held_out": held_back}
    print(f"make-prompts: {source.name}: {files} files, {len(kept)} prompts"
          f"{f', {repeated} repeated snippets dropped' if repeated else ''}"
          f"{f', {held_back} mostly held-out dropped' if held_back else ''} ({time.monotonic() - started:.1f} s)",
          file=log)
    return kept


def balanced(per_source: list[list[dict]], limit: int, rng: random.Random) -> list[dict]:
    """Up to `limit` prompts, taken from each source in turn (a held-out set covers every source evenly)."""
    queues = [rng.sample(prompts, len(prompts)) for prompts in per_source if prompts]
    chosen = []
    while queues and len(chosen) < limit:
        queues = [q for q in queues if q]
        for queue in queues[:limit - len(chosen)]:
            chosen.append(queue.pop())
    return chosen


def build_set(sources: list[Source], limit: int, seed: int = 0, per_file: int = 8, even: bool = False,
              guard: list[Source] = (), log=None) -> Build:
    """Prompts from `sources`, shuffled by `seed`, at most `limit` (taken evenly across sources when `even`); a
    snippet made mostly of lines of a `guard` source is left out."""
    build, seen, log = Build(), set(), log or sys.stderr
    held = held_out_lines(list(guard), log) if guard else set()
    per_source = [take_source(source, seed, per_file, seen, held, build, log) for source in sources]
    rng = random.Random(seed)
    if even:
        build.prompts = balanced(per_source, limit, rng)
    else:
        build.prompts = [p for prompts in per_source for p in prompts]
        rng.shuffle(build.prompts)
        build.prompts = build.prompts[:limit]
    rng.shuffle(build.prompts)
    return build


def summary(build: Build, name: str, seed: int, out: Path) -> dict:
    taken = Counter(p["source"].split("/", 1)[0] for p in build.prompts)
    sources = {n: {**info, "prompts": taken.get(n, 0)} for n, info in build.sources.items()}
    return {"set": name, "seed": seed, "prompts": len(build.prompts), "file": out.name,
            "files_seen": sum(s["files"] for s in sources.values()),
            "kinds": dict(sorted(Counter(p["kind"] for p in build.prompts).items())),
            "licences": dict(sorted(Counter(p["licence"] for p in build.prompts).items())),
            "sources": sources, "skipped": build.skipped}


# ------------------------------------------------------------------------------------------ the command


def summary_path(out: Path) -> Path:
    """train.jsonl.xz -> train.summary.json, beside it."""
    name = out.name
    for suffix in (".xz", ".gz", ".jsonl"):
        name = name.removesuffix(suffix)
    return out.with_name(name + ".summary.json")


def print_table(title: str, counts: dict, log) -> None:
    width = max(map(len, counts), default=0)
    print(f"  {title}:", file=log)
    for name, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        print(f"    {name:<{width}} {n:>7}", file=log)


def write_set(build: Build, name: str, seed: int, out: Path, log) -> None:
    if not build.prompts:
        raise TreeserveError(f"no prompts for {name}: every source was missing or empty")
    write_prompts(out, build.prompts)
    report = summary(build, name, seed, out)
    summary_path(out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"make-prompts: {name}: {report['prompts']} prompts from {report['files_seen']} files -> {out} "
          f"({out.stat().st_size / 2**20:.1f} MiB), summary {summary_path(out)}", file=log)
    print_table("kinds", report["kinds"], log)
    print_table("sources", {n: s["prompts"] for n, s in report["sources"].items()}, log)


def named_sources(names: list[str]) -> list[Source]:
    known = {s.name: s for s in SOURCES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise TreeserveError(f"unknown sources: {', '.join(unknown)} (see --list-sources)")
    return [known[n] for n in names]


def build_preset(preset: str, seed: int, per_file: int, limit: int | None, log) -> Build:
    split, size = PRESETS[preset]
    chosen = [s for s in SOURCES if s.split == split]
    guard = [s for s in SOURCES if s.split != TRAIN] if split == TRAIN else []
    return build_set(chosen, limit or size, seed, per_file, even=split != TRAIN, guard=guard, log=log)


def list_sources() -> None:
    for source in SOURCES:
        try:
            where, files = source.where.files()
            state = f"{len(files)} files in {where}"
        except Missing as why:
            state = f"missing: {why}"
        print(f"{source.name:<24} {source.split:<16} {source.licence:<40} {state}")


FLIT_CORE = "flit_core==4.2.0"  # Sphinx's build backend, to read its sdist's metadata


def install_commands() -> list[str]:
    """The commands that install every registered source that is not part of the venv."""
    debian = sorted({s.where.package for s in SOURCES if isinstance(s.where, DebianPackage)})
    npm_packages = sorted({f"{s.where.name}@{s.where.version}" for s in SOURCES if isinstance(s.where, NpmPackage)})
    sdists = sorted({f"{s.where.name}=={s.where.version}" for s in SOURCES if isinstance(s.where, PypiSdist)})
    return [f"apt-get install -y --no-install-recommends {' '.join(debian)}",
            f"npm install --prefix {NPM_PREFIX} --no-save --no-audit --no-fund --ignore-scripts "
            f"{' '.join(npm_packages)}",
            # Without build isolation pip reads each sdist's metadata with the venv's own build backends
            # (setuptools, and flit_core for Sphinx) instead of first building its build requirements (Cython
            # among them) from source: seconds, not minutes.
            f"{sys.executable} -m pip install {FLIT_CORE}",
            f"{sys.executable} -m pip download --no-binary :all: --no-deps --no-build-isolation --dest {PYPI_FOLDER} "
            f"{' '.join(sdists)}",
            f'for f in {PYPI_FOLDER}/*.tar.gz; do tar -xzf "$f" -C {PYPI_FOLDER}; done']


def run(args) -> int:
    """`treeserve make-prompts`: write prompts as JSONL, one {"prompt", "chat", "kind", "source", "licence"} a
    line, compressed by the output's suffix (.xz, .gz), and a summary JSON beside it."""
    log = sys.stderr
    if args.list_sources:
        list_sources()
        return 0
    if args.install_commands:
        print("\n".join(install_commands()))
        return 0
    if args.out is None:
        raise TreeserveError("--out is needed")
    if (args.limit is not None and args.limit < 1) or args.per_file < 1:
        raise TreeserveError(f"--limit and --per-file must be at least 1, got {args.limit} and {args.per_file}")
    if shutil.which("groff") is None:
        print("make-prompts: groff not found: manual pages will be skipped (apt-get install groff-base)", file=log)
    started = time.monotonic()
    if args.roots:
        for root in args.roots:
            if not root.is_dir():
                raise TreeserveError(f"--from {root}: not a folder")
        folders = [Source(root.name, TRAIN, Folder(root, exclude=tuple(args.exclude)), args.licence)
                   for root in args.roots]
        write_set(build_set(folders, args.limit or 10000, args.seed, args.per_file, log=log), "folders",
                  args.seed, args.out, log)
    elif args.sources:
        chosen = named_sources([n for n in args.sources.split(",") if n])
        write_set(build_set(chosen, args.limit or 10000, args.seed, args.per_file, log=log), "sources",
                  args.seed, args.out, log)
    else:
        presets = list(PRESETS) if args.preset == "all" else [args.preset]
        for preset in presets:
            out = args.out if preset == "training" else args.held_out_dir / HELD_OUT_FILES[preset] \
                if args.preset == "all" else args.out
            write_set(build_preset(preset, args.seed, args.per_file, args.limit, log), preset, args.seed, out, log)
    print(f"make-prompts: done in {time.monotonic() - started:.0f} s", file=log)
    return 0

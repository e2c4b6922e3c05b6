"""The layout is the architecture: the cores, the storage engine, the selectors and the
fault simulator are plain Python that imports without Ray (tested logic without Ray,
wiring with Ray)."""

from __future__ import annotations

import subprocess
import sys

NO_RAY = """
import importlib, pkgutil, sys

class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"{name} imported by a module that must not need Ray")
        return None

sys.meta_path.insert(0, NoRay())
import raymq.core, raymq.storage, raymq.selector, raymq.sim
for package in (raymq.core, raymq.storage, raymq.selector, raymq.sim):
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
print(sorted(m for m in sys.modules if m.startswith("raymq")))
"""


def test_cores_storage_and_selectors_import_without_ray():
    done = subprocess.run([sys.executable, "-c", NO_RAY], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = done.stdout
    for module in (
        "raymq.core.queue",
        "raymq.core.target_list",
        "raymq.core.registry",
        "raymq.storage.writer",
        "raymq.selector.evaluate",
        "raymq.sim.run",
    ):
        assert f"'{module}'" in loaded


def test_every_package_is_installed_by_a_non_editable_install():
    """pyproject.toml lists its packages one by one; a package missing there works in
    the editable install the tests use and is absent from a wheel (raymq.core was)."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml")) as f:
        text = f.read()
    listed = set(re.findall(r'"(raymq(?:\.\w+)*)"', text.split("[tool.setuptools]")[1]))
    found = {"raymq.actors", "raymq.placement"}
    for dirpath, _dirs, files in os.walk(os.path.join(root, "raymq")):
        if "__init__.py" in files and "__pycache__" not in dirpath:
            found.add(os.path.relpath(dirpath, root).replace(os.sep, "."))
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"

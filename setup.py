"""Install every package under the `phalanx` import name while the repository keeps its top-level
folders (peer/, protocol/, tools/, …): `phalanx.peer` is ./peer, and so on. pyproject.toml holds the rest."""

from setuptools import find_packages, setup

FOLDERS = ("peer", "protocol", "aggregation", "security", "sim", "tasks", "tools")

setup(
    packages=["phalanx"] + [f"phalanx.{folder}.{sub}".rstrip(".") for folder in FOLDERS for sub in ["", *find_packages(folder)]],
    package_dir={"phalanx": "phalanx", **{f"phalanx.{folder}": folder for folder in FOLDERS}},
)

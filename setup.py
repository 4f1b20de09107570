"""The build's one step beyond pyproject.toml: schema.sql, its Postgres port schema.postgres.sql and packs/ live
once, at the top of the repository (the design card's layout), and the built package carries them inside it, where
the installed program reads them (switchboard.configuration.shipped_path)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

TOP_LEVEL_DATA = ("schema.sql", "schema.postgres.sql", "packs")


class BuildWithTopLevelData(build_py):
    """build_py, then the schemas and packs/ copied into the package's build directory."""

    def run(self) -> None:
        super().run()
        package = Path(self.build_lib) / "switchboard"
        for name in TOP_LEVEL_DATA:
            source = Path(__file__).resolve().parent / name
            if source.is_dir():
                shutil.copytree(source, package / name, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(source, package / name)


setup(cmdclass={"build_py": BuildWithTopLevelData})

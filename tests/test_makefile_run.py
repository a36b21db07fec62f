"""`make run` works on a fresh clone: the job refuses an -o path whose directory is missing, so the
recipe creates that directory before the run writes into it."""

import re
from pathlib import Path

MAKEFILE = Path(__file__).resolve().parent.parent / "Makefile"


def _recipe(target: str) -> list[str]:
    lines = MAKEFILE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_the_run_recipe_creates_its_output_directory_first():
    recipe = _recipe("run")
    runs = [i for i, line in enumerate(recipe) if " run " in line and " -o " in line]
    assert runs, recipe
    output = re.search(r" -o (\S+)", recipe[runs[0]]).group(1)
    directory = str(Path(output).parent)
    made = [i for i, line in enumerate(recipe) if line.startswith("mkdir -p") and directory in line.split()]
    assert made and made[0] < runs[0], recipe

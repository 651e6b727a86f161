"""The README's API tour runs as written."""
import re
from pathlib import Path


def test_readme_api_tour_runs():
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    tour = text.split("## API tour", 1)[1]
    code = re.search(r"```python\n(.*?)```", tour, re.S).group(1)
    exec(compile(code, "README.md:api-tour", "exec"), {})

"""Build and cached-load time of the compressed map for a 131,072-id tokenizer (WordLevel over random words).

Prints a table and the result JSON, and writes it through engram.bench.report (a temporary directory).
"""
import json
import os
import random
import tempfile
import time

from tokenizers import Tokenizer, models

from engram.bench import report
from engram.tokenizer import CompressedTokenizer

VOCAB = 131_072
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZéèüñçÅＡＢ日本語 \t"


def random_tokenizer(seed: int = 0) -> Tokenizer:
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < VOCAB:
        words.add("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 9))))
    vocab = {w: i for i, w in enumerate(sorted(words))}
    return Tokenizer(models.WordLevel(vocab=vocab, unk_token=next(iter(vocab))))


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        os.environ["ENGRAM_CACHE_DIR"] = d  # a cold cache: the first load builds, the second reads the file
        path = os.path.join(d, "tokenizer.json")
        random_tokenizer().save(path)
        t = time.perf_counter()
        built = CompressedTokenizer.from_file(path)
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        CompressedTokenizer.from_file(path)
        load_s = time.perf_counter() - t
    result = {"vocab": built.vocab_size, "compressed": len(built), "build_s": round(build_s, 3),
              "cached_load_s": round(load_s, 4)}
    out = report.write_result("tokenizer-map", {"vocab": VOCAB, "seed": 0}, result)
    print(report.format_table([result]))
    print(json.dumps(result))
    print(f"result: {out}")


if __name__ == "__main__":
    main()

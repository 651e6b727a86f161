"""Build and cached-load time of the compressed map for a 131,072-id tokenizer (WordLevel over random words)."""
import os, time, tempfile, json, random
from tokenizers import Tokenizer, models
from engram.tokenizer import CompressedTokenizer
random.seed(0)
alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZéèüñçÅＡＢ日本語 \t"
words = set()
while len(words) < 131072:
    words.add("".join(random.choice(alphabet) for _ in range(random.randint(1, 9))))
vocab = {w: i for i, w in enumerate(sorted(words))}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=next(iter(vocab))))
d = tempfile.mkdtemp(); os.environ["ENGRAM_CACHE_DIR"] = d
p = os.path.join(d, "tokenizer.json"); tok.save(p)
t = time.perf_counter(); c = CompressedTokenizer.from_file(p); build = time.perf_counter() - t
t = time.perf_counter(); c2 = CompressedTokenizer.from_file(p); load = time.perf_counter() - t
print(json.dumps({"vocab": c.vocab_size, "compressed": len(c), "build_s": round(build, 3), "cached_load_s": round(load, 4)}))

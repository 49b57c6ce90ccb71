#!/usr/bin/env python3
"""Builds the tokenizer test corpus: tests/data/tokenizer/corpus_*.txt.

Every file is a list of chunks separated by the line CHUNK_SEP (so a failure points at one
chunk); each chunk is tokenized on its own. Sources, all public domain or written for d2o:
  bible      King James Bible passages (Debian bible-kjv: `bible -p /usr/lib ...`)
  austen     Jane Austen, Emma / Pride and Prejudice / Persuasion (Debian r-cran-janeaustenr, via R)
  code       d2o's own source files
  numbers    generated numbers, dates, times, amounts, digits of many scripts
  whitespace generated runs of spaces, tabs, newlines, CR LF and Unicode spaces
  scripts    sentences written for d2o in many scripts, and pseudo-words drawn from Unicode
             letter ranges (including letters new in Unicode 15.0 / 15.1)
  emoji      emoji with skin tones, ZWJ sequences, flags, keycaps, variation selectors
  edge       combining marks, contractions, special-token look-alikes, control characters,
             noncharacters, private use, the highest code points, long runs
Deterministic (fixed seeds). Needs: bible-kjv, r-base-core + r-cran-janeaustenr.

    python3 scripts/gen_tokenizer_corpus.py            # writes tests/data/tokenizer/
then regenerate the expected ids with scripts/gen_tokenizer_fixtures.sh.
"""
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "tokenizer")
CHUNK_SEP = "\n@@@@ d2o chunk @@@@\n"


def write(name, chunks):
    for c in chunks:
        assert CHUNK_SEP not in c and c, name
    path = os.path.join(OUT, f"corpus_{name}.txt")
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(CHUNK_SEP.join(chunks))
    print(f"{path}: {len(chunks)} chunks, {os.path.getsize(path)} bytes")


def split_paragraphs(text, target):
    """Cuts text at blank lines into chunks of about `target` characters."""
    chunks, cur = [], ""
    for para in text.split("\n\n"):
        cur = cur + "\n\n" + para if cur else para
        if len(cur) >= target:
            chunks.append(cur)
            cur = ""
    if cur:
        chunks.append(cur)
    return chunks


def bible():
    refs = ["gen1:1-gen3:24", "exo20:1-exo20:26", "psa23:1-psa23:6", "psa119:1-psa119:40",
            "pro3:1-pro4:27", "ecc1:1-ecc3:22", "isa40:1-isa40:31", "mat5:1-mat7:29",
            "luk2:1-luk2:52", "joh1:1-joh1:51", "act2:1-act2:47", "rom8:1-rom8:39",
            "1co13:1-1co13:13", "rev21:1-rev22:21"]
    chunks = []
    for r in refs:
        text = subprocess.run(["bible", "-p", "/usr/lib", "-m", "8192", r], check=True,
                              capture_output=True, text=True).stdout
        chunks += split_paragraphs(text.strip("\n"), 3000)
    return chunks


def austen():
    with tempfile.TemporaryDirectory() as d:
        script = ("library(janeaustenr); writeLines(emma, '{0}/emma.txt'); "
                  "writeLines(prideprejudice, '{0}/pp.txt'); "
                  "writeLines(persuasion, '{0}/pers.txt')").format(d)
        subprocess.run(["Rscript", "-e", script], check=True, capture_output=True)
        books = [open(os.path.join(d, f), encoding="utf-8").read()
                 for f in ("emma.txt", "pp.txt", "pers.txt")]
    chunks = []
    for book, n in zip(books, (30000, 20000, 12000)):
        chunks += split_paragraphs(book[:n], 2500)
    return chunks


def code():
    files = ["src/core/status.cpp", "src/core/thread_pool.cpp", "src/core/thread_pool.h",
             "src/core/mem.h", "src/core/cpu.cpp", "src/gguf/gguf.h", "src/gguf/gguf.cpp",
             "src/gguf/gguf_writer.cpp", "src/ops/ggml_type.h", "CMakeLists.txt",
             "scripts/gen_unicode_tables.py"]
    chunks = []
    for f in files:
        text = open(os.path.join(ROOT, f), encoding="utf-8").read()
        # Whole functions: cut at blank lines into ~2500-character chunks.
        chunks += split_paragraphs(text, 2500)
    return chunks


def numbers():
    rng = random.Random(1234)
    months = ["January", "February", "March", "April", "May", "June", "July", "August",
              "September", "October", "November", "December"]
    digit_sets = ["0123456789", "٠١٢٣٤٥٦٧٨٩", "۰۱۲۳۴۵۶۷۸۹", "०१२३४५६७८९", "০১২৩৪৫৬৭৮৯",
                  "๐๑๒๓๔๕๖๗๘๙", "０１２３４５６７８９", "𝟎𝟏𝟐𝟑𝟒𝟓𝟔𝟕𝟖𝟗", "၀၁၂၃၄၅၆၇၈၉"]
    chunks = []
    for c in range(14):
        parts = []
        for _ in range(60):
            k = rng.randrange(16)
            n = rng.randrange(1, 21)
            if k == 0:
                parts.append("".join(rng.choice("0123456789") for _ in range(n)))
            elif k == 1:
                parts.append(f"{rng.uniform(-1e6, 1e6):.{rng.randrange(0, 7)}f}")
            elif k == 2:
                parts.append(f"{rng.randrange(10**9):,}")
            elif k == 3:
                parts.append(f"{rng.randrange(1900, 2100)}-{rng.randrange(1, 13):02d}-"
                             f"{rng.randrange(1, 29):02d}")
            elif k == 4:
                parts.append(f"{rng.randrange(1, 29)} {rng.choice(months)} "
                             f"{rng.randrange(1, 2100)}, {rng.randrange(24):02d}:"
                             f"{rng.randrange(60):02d}:{rng.randrange(60):02d}")
            elif k == 5:
                parts.append(f"{rng.randrange(1, 13)}/{rng.randrange(1, 32)}/"
                             f"{rng.randrange(100):02d}")
            elif k == 6:
                parts.append(f"${rng.randrange(10**7) / 100:,.2f} or €{rng.randrange(999)},"
                             f"{rng.randrange(100):02d} or £{rng.randrange(50)}")
            elif k == 7:
                parts.append(f"+1 ({rng.randrange(200, 999)}) {rng.randrange(200, 999)}-"
                             f"{rng.randrange(10000):04d}")
            elif k == 8:
                parts.append(".".join(str(rng.randrange(256)) for _ in range(4)))
            elif k == 9:
                parts.append(f"0x{rng.getrandbits(4 * n):X} {rng.getrandbits(32):#010b}")
            elif k == 10:
                parts.append(f"{rng.uniform(0, 10):.3e} {rng.randrange(100)}% "
                             f"{rng.randrange(10)}.{rng.randrange(10)}.{rng.randrange(30)}")
            elif k == 11:
                ds = rng.choice(digit_sets)
                parts.append("".join(rng.choice(ds) for _ in range(n)))
            elif k == 12:
                parts.append(rng.choice(["½", "¾", "⅓", "²", "³", "¹⁰", "₁₂", "Ⅻ", "ⅳ", "①",
                                         "⑳", "⓾", "〇", "十二", "𝟗𝟗", "፲፱"]) * rng.randrange(1, 4))
            elif k == 13:
                parts.append(f"{rng.randrange(1, 100)}{rng.choice(['st', 'nd', 'rd', 'th'])} "
                             f"item{rng.randrange(1000)}x{rng.randrange(99)}")
            elif k == 14:
                a, b = rng.randrange(1000), rng.randrange(1000)
                parts.append(f"{a}×{b}={a * b}; {a}-{b}={a - b}; {a}/{b}≈{a / (b or 1):.4f}")
            else:
                parts.append(f"v{rng.randrange(10)}.{rng.randrange(20)}.{rng.randrange(100)}"
                             f"-rc{rng.randrange(5)}")
        seps = [" ", ", ", "\n", "\t", " | ", "; ", "  "]
        chunks.append("".join(p + rng.choice(seps) for p in parts).rstrip())
    return chunks


def whitespace():
    rng = random.Random(99)
    words = ["alpha", "beta", "gamma", "delta", "if", "x", "return", "42", "(a)", "{", "}",
             "Über", "naïve", "日本", "мир", "—", "...", "'s", "I'll"]
    spaces = [" ", "  ", "   ", "    ", "        ", "\t", "\t\t", "\n", "\n\n", "\n\n\n",
              "\r\n", "\r\n\r\n", " \n", "\n ", " \t ", "\t\n", "\n\t\t", "\r", "\x0b",
              "\x0c", "\u00a0", "\u2002", "\u2003", "\u2009", "\u200a", "\u3000", "\u1680",
              "\u205f", "\u202f", "\u2028", "\u2029", "\u0085", " \u00a0 ", "\u200b",
              "\ufeff", " " * 17, "\t" * 9, "\n" * 12, " \n \n ", "\u3000\u3000"]
    chunks = []
    for c in range(24):
        parts = [rng.choice(spaces)] if c % 3 == 0 else []
        for _ in range(rng.randrange(80, 160)):
            parts.append(rng.choice(words))
            parts.append(rng.choice(spaces))
        if c % 2:
            parts.append(rng.choice(words))  # some chunks end without whitespace
        chunks.append("".join(parts))
    # Long runs.
    chunks.append("start" + " " * 1000 + "end")
    chunks.append("\n" * 300 + "x" + "\t" * 300 + "y" + " \t" * 200)
    chunks.append("    indented\n        more\n\t\ttabbed\n  \n    \n" * 20)
    return chunks


def scripts():
    sentences = [
        "Привет! Сегодня мы проверяем токенизатор: числа 123, даты и знаки препинания.",
        "Быстрая коричневая лиса перепрыгивает через ленивую собаку; съешь ещё этих булок.",
        "Γεια σου, κόσμε! Ο αλγόριθμος χωρίζει τις λέξεις σε κομμάτια.",
        "Η ΓΛΩΣΣΑ ΕΙΝΑΙ ΠΛΟΥΣΙΑ· ποιος ξέρει πόσα σύμβολα χρειάζονται;",
        "مرحبا بالعالم! هذا اختبار بسيط للنص العربي مع أرقام ١٢٣ و 456.",
        "الذكاء الاصطناعي يتعلم من البيانات، ويكتب النصوص بسرعة.",
        "שלום עולם! זהו מבחן קצר בעברית, עם מספרים 789 וסימנים.",
        "नमस्ते दुनिया! यह हिंदी में एक छोटा परीक्षण है, संख्या १२३ के साथ।",
        "মেশিন লার্নিং মডেল শব্দগুলোকে টোকেনে ভাগ করে।",
        "வணக்கம் உலகம்! இது ஒரு சிறிய சோதனை.",
        "你好，世界！这是一个测试分词器的句子，包括数字２０２４和标点。",
        "今天天气很好，我们去公园散步吧。机器学习需要大量的数据。",
        "こんにちは、世界！これはトークナイザーのテストです。カタカナとひらがな。",
        "東京は日本の首都です。ラーメンを食べたいです！",
        "안녕하세요, 세계! 이것은 토크나이저 테스트입니다. 숫자 42와 함께.",
        "สวัสดีชาวโลก นี่คือการทดสอบภาษาไทยที่ไม่มีช่องว่างระหว่างคำ",
        "გამარჯობა, მსოფლიო! ეს არის ტესტი.",
        "Բարև, աշխարհ։ Սա փորձարկում է։",
        "ሰላም ለዓለም! ይህ ሙከራ ነው።",
        "Xin chào thế giới! Đây là bài kiểm tra tiếng Việt có dấu.",
        "Merhaba dünya! İstanbul'da ılık bir gün; ĞÜŞİÖÇ ğüşıöç.",
        "Zażółć gęślą jaźń — pchnąć w tę łódź jeża lub ośm skrzyń fig.",
        "Größe, Straße, Fußgänger: Übermäßig schöne Äpfel für Ärzte.",
        "Où est la bibliothèque ? À côté de l'église, près du café « Chez Noël ».",
        "¿Qué tal? ¡Muy bien! El niño comió piñata en año nuevo.",
        "Ελληνικά, Кириллица, עברית, العربية, हिन्दी, 中文, 日本語, 한국어 in one line.",
    ]
    rng = random.Random(7)
    letter_ranges = [
        (0x0400, 0x04FF), (0x0370, 0x03FF), (0x0600, 0x06FF), (0x05D0, 0x05EA),
        (0x0900, 0x097F), (0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3),
        (0x0E00, 0x0E7F), (0x10A0, 0x10FF), (0x1200, 0x137F), (0x0B80, 0x0BFF),
        (0x1780, 0x17FF), (0x0F00, 0x0FFF), (0x1E00, 0x1EFF), (0x20000, 0x2A6DF),
        # Unicode 15.0 / 15.1 letters: CJK Ext H and I, Kawi, Nag Mundari, Cyrillic Ext-D.
        (0x31350, 0x323AF), (0x2EBF0, 0x2EE5D), (0x11F04, 0x11F10), (0x1E4D0, 0x1E4EB),
        (0x1E030, 0x1E06D),
    ]
    chunks = []
    for i in range(0, len(sentences), 3):
        chunks.append("\n".join(sentences[i:i + 3]) * 3)
    for c in range(30):
        words = []
        for _ in range(rng.randrange(60, 120)):
            lo, hi = rng.choice(letter_ranges)
            w = "".join(chr(rng.randrange(lo, hi + 1)) for _ in range(rng.randrange(1, 9)))
            words.append(w + rng.choice([" ", " ", " ", ", ", ". ", "\n", "", "-"]))
        chunks.append("".join(words).strip() or "x")
    return chunks


def emoji():
    items = [
        "😀", "😂", "🥲", "🤖", "🦙", "🚀", "✅", "❤️", "❤", "♥️", "👍", "👍🏻", "👍🏼", "👍🏽",
        "👍🏾", "👍🏿", "👋🏽", "🧑‍💻", "👩🏽‍🚀", "👨‍👩‍👧‍👦", "👩‍❤️‍💋‍👨", "🏳️‍🌈", "🏴‍☠️", "😶‍🌫️",
        "🧔🏻‍♂️", "🇺🇸", "🇯🇵", "🇫🇷🇩🇪", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "1️⃣", "#️⃣", "*️⃣", "©️", "™", "☺", "☺️",
        "🫨", "🩷", "🪿", "🫎", "🐦‍⬛", "🧑🏿‍🦽‍➡️", "⌚", "⏰", "🀄", "🃏", "🎉🎊", "💯", "🔥🔥🔥",
    ]
    rng = random.Random(5)
    texts = ["I love this", "ship it", "good morning", "team", "we did it", "hmm", "ok",
             "見て", "смотри", "voilà"]
    chunks = []
    for c in range(12):
        parts = []
        for _ in range(rng.randrange(40, 80)):
            if rng.random() < 0.4:
                parts.append(rng.choice(texts))
            parts.append("".join(rng.choice(items) for _ in range(rng.randrange(1, 4))))
            parts.append(rng.choice([" ", "", "\n", "! ", ". "]))
        chunks.append("".join(parts))
    chunks.append(" ".join(items))
    chunks.append("".join(items))
    return chunks


def edge():
    chunks = [
        # Combining marks: decomposed accents, stacks, scripts with marks.
        "cafe\u0301 nai\u0308ve re\u0301sume\u0301 Zo\u0308e\u0308 n\u0303 a\u030a",
        "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334a\u0325l\u0360g\u0315o"
        "\u0337\u0361 t\u0322e\u0341x\u0357t\u0350 \u0308\u0301\u0302",
        "\u05e9\u05c1\u05b8\u05dc\u05d5\u05b9\u05dd \u0645\u064e\u0631\u0652\u062d\u064e"
        "\u0628\u064b\u0627 \u0915\u093f\u0924\u093e\u092c \u1100\u1161\u11a8 \u1112\u1161"
        "\u11ab\u1100\u1173\u11af",
        # Contractions, apostrophes, quotes.
        "I'm you're he's she'd we'll they've it's don't can't won't I'd y'all o'clock",
        "I'M YOU'RE HE'S SHE'D WE'LL THEY'VE IT'S DON'T I'D 'S 'T 'RE 'VE 'M 'LL 'D",
        "it’s don’t ‘quoted’ “double” «guillemets» „Anführung“ ' ' '' ''' 's 'sss ' s",
        "a's b't c're d've e'm f'll g'd 1's 2'll ' 're' 'll' x' 'y",
        "Hello , world ! Are you sure ? Yes . ' quoted ' and 'single' ; it 's fine .",
        # Special-token look-alikes (parse_special off: plain text).
        "<|im_start|>user\nhi<|im_end|>\n<|endoftext|></s><s>[INST] x [/INST]<pad>",
        "<|im_start|><|im_start|> <|im_end|>x<|endoftext|>y <repo_name> <file_sep>",
        # Code-like and markup.
        "foo_bar(baz)->qux[0] += 0x1F; // done\nif (a && b || !c) { return a<<2 >> 1; }",
        "https://example.org/path?q=1&r=two#frag user.name+tag@mail.example.com ~/x/y.txt",
        "**bold** _it_ `code` # Title\n- item\n> quote\n| a | b |\n|---|---|",
        '<div class="x" id=\'y\'>&amp; &lt;tag&gt; &#169;</div> {"k": [1, 2.5, null, true]}',
        # Control characters and unusual code points (all valid UTF-8).
        "tab\there\x01\x02\x03\x07\x08\x0e\x0f\x10\x1b[31mred\x1b[0m\x7f\x1c\x1d\x1e\x1f end",
        "NUL\x00inside \u0080\u0085\u0090\u009f C1 controls",
        "\ufeffBOM \ufffd replacement \ufffe\uffff nonchars \ue000\uf8ff private",
        "\U000f0000\U0010fffd\U0010ffff top \ud7ff\ue000 edge \U0001d11e\U0001f600",
        "\u200b zero\u200bwidth \u200c\u200d joiners \u2060 \u00ad soft\u00adhyphen \u061c",
        "\u202e reversed \u202c \u2066 isolate \u2069 \ufff9 \U000e0001\U000e0041",
        # Mixed classes glued together.
        "abc123def 123abc ABC_def-ghi.jkl a1b2c3 ½x x² 3D 4K 1080p H2O CO₂ ℃ №5",
        "....!!!???,,,;;;::: ---___ === +++ *** ### $$$ %%% ^^^ &&& ||| ~~~ ``` \\\\",
        "( ) [ ] { } < > / \\ | ' \" ` ´ ¨ ^ ¸ ˜ ¯ ˘ ˙ ˚ ˛ ˝",
        # Long runs (long words for BPE).
        "a" * 3000,
        "ab" * 1500,
        "9" * 2000,
        "!" * 1500 + "?" * 500,
        "supercalifragilisticexpialidocious" * 40,
        "日本語" * 600,
        "😀" * 400,
        "e\u0301" * 500,
    ]
    return chunks


def invalid_utf8():
    """Byte strings that are not UTF-8: llama.cpp turns each undecodable byte into U+FFFD."""
    return [
        b"stray \x80 continuation \xbf bytes \x80\x80\x80 end",
        b"truncated \xe4\xbd at end \xe4",
        b"truncated two-byte \xc3 and four-byte \xf0\x9f\x98 sequences \xf0\x9f",
        b"overlong \xc0\xaf \xc1\xbf \xe0\x80\xaf slash",
        b"surrogates \xed\xa0\x80 \xed\xbf\xbf pair \xed\xa0\xbd\xed\xb8\x80",
        b"bytes \xfe \xff \xf8\x88\x80\x80\x80 \xfc never valid",
        b"mixed \xe6\x97\xa5\xe6\x9c \xac\xe8\xaa\x9e and caf\xe9 latin-1",
        b"\xff\xfe\x00h\x00i UTF-16 BOM",
        b"\x80\x81\x82\x83\x84\x85\x86\x87\x88\x89\x8a\x8b\x8c\x8d\x8e\x8f" * 8,
    ]


def main():
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "bytes_invalid_utf8.txt")
    with open(path, "wb") as f:
        f.write(CHUNK_SEP.encode().join(invalid_utf8()))
    print(f"{path}: {os.path.getsize(path)} bytes")
    for name, fn in [("bible", bible), ("austen", austen), ("code", code),
                     ("numbers", numbers), ("whitespace", whitespace), ("scripts", scripts),
                     ("emoji", emoji), ("edge", edge)]:
        write(name, fn())


if __name__ == "__main__":
    sys.exit(main())

// Shared helpers of the golden generators (gen_encode_golden.js, gen_sentencepiece_golden.js).

// seededRandom returns a mulberry32 PRNG in [0, 1) so every generated file is reproducible.
function seededRandom(seed) {
  return function rnd() {
    seed |= 0; seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// textMaker returns texts(count): the hard cases followed by random concatenations of atoms.
function textMaker(rnd, atoms, hard) {
  const pick = (a) => a[Math.floor(rnd() * a.length)];
  const randomText = () => {
    const n = 1 + Math.floor(rnd() * 24);
    let s = '';
    for (let i = 0; i < n; i++) s += pick(atoms);
    return s;
  };
  return (count) => {
    const out = hard.slice();
    while (out.length < count) out.push(randomText());
    return out;
  };
}

// encodeAll encodes every text without and with special tokens (tokSpecial, when given, is the
// tokenizer whose post-processor adds them).
async function encodeAll(tok, list, tokSpecial) {
  const out = [];
  for (const text of list) {
    const plain = await tok.encode(text, null, { addSpecialTokens: false });
    const withSpecial = await (tokSpecial || tok).encode(text, null, { addSpecialTokens: true });
    out.push({ text, ids: plain.getIds(), ids_special: withSpecial.getIds() });
  }
  return out;
}

module.exports = { seededRandom, textMaker, encodeAll };

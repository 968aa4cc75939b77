// Adds reference token ids (npm tokenizers 0.23.2, add_special_tokens=false) to the prompts
// rendered by gen_chat_golden.py, writing qwen3-chat-golden.json.
//   NODE_PATH=/path/to/node_modules node gen_chat_ids.js ../../../../shared/models/qwen3
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('tokenizers');
(async () => {
  const tok = Tokenizer.fromFile(path.join(process.argv[2] || '../../../../shared/models/qwen3', 'tokenizer.json'));
  const g = JSON.parse(fs.readFileSync(path.join(__dirname, 'qwen3-chat-prompts.json'), 'utf8'));
  for (const c of g.cases) {
    c.token_ids = (await tok.encode(c.rendered_prompt, null, { addSpecialTokens: false })).getIds();
  }
  g.generator += ' + npm tokenizers 0.23.2';
  fs.writeFileSync(path.join(__dirname, 'qwen3-chat-golden.json'), JSON.stringify(g, null, 1) + '\n');
  fs.unlinkSync(path.join(__dirname, 'qwen3-chat-prompts.json'));
})();

#!/usr/bin/env node
// A Conveyor client in JavaScript: only the official `nats` package and a msgpack package.
// It follows docs/wire-protocol.md: subscribe to an inbox, answer liveness probes on
// `<inbox>.alive`, publish a msgpack ChatRequest to `<ns>.work.processor` through JetStream
// (Nats-Msg-Id = request id), then print chunks in order until the final frame.
//
//   npm install && node chat.mjs "What is the capital of France?"
//   CONVEYOR_NATS_URLS=nats://host:4222 CONVEYOR_NAMESPACE=conveyor CONVEYOR_MODEL=... node chat.mjs "..."
import { connect, headers } from "nats";
import { decode, encode } from "@msgpack/msgpack";
import { randomUUID } from "node:crypto";

const prompt = process.argv.slice(2).join(" ") || "What is the capital of France?";
const servers = (process.env.CONVEYOR_NATS_URLS || "nats://127.0.0.1:4222").split(",");
const namespace = process.env.CONVEYOR_NAMESPACE || "conveyor";
const model = process.env.CONVEYOR_MODEL || "SmolLM2-135M-Instruct";
const maxTokens = Number(process.env.CONVEYOR_MAX_TOKENS || 64);
const heartbeatTimeoutMs = 10000;

const nc = await connect({ servers });
const requestId = `node-${randomUUID()}`;
const inbox = `${nc.options.inboxPrefix || "_INBOX"}.${randomUUID().replaceAll("-", "")}`;

// Subscribe before publishing, or early frames are lost.
const frames = nc.subscribe(inbox);
// Tell the probing worker where we are: after a NATS restart it sends again what we lack.
let expected = 0;
const alive = nc.subscribe(`${inbox}.alive`, { callback: (_err, msg) => msg.respond(encode({ next_seq: expected })) });

const request = {
  kind: "chat",
  request_id: requestId,
  reply_to: inbox,
  model,
  messages: [{ role: "user", content: prompt }],
  stream_format: "text",
  max_tokens: maxTokens,
  temperature: 0,
};
const h = headers();
h.set("Conveyor-Wire", "1");
await nc.jetstream().publish(`${namespace}.work.processor`, encode(request), { msgID: requestId, headers: h });

let exitCode = 0;
const ahead = new Map(); // frames that arrived before a missing one, by seq
const iterator = frames[Symbol.asyncIterator]();
for (;;) {
  const timeout = new Promise((resolve) => setTimeout(() => resolve({ timeout: true }), expected === 0 ? 60000 : heartbeatTimeoutMs));
  const next = await Promise.race([iterator.next(), timeout]);
  if (next.timeout) {
    console.error(`\n[node] no frame for ${expected === 0 ? 60 : heartbeatTimeoutMs / 1000} s: the stream broke`);
    exitCode = 3;
    break;
  }
  const frame = decode(next.value.data);
  if (frame.kind === "error") {
    console.error(`\n[node] ${frame.code}: ${frame.message}${frame.retryable ? " (retryable)" : ""}`);
    exitCode = 1;
    break;
  }
  // Sent again (a migration, a reconnect): already had it.
  if (frame.seq < expected) continue;
  if (frame.seq > expected) {
    ahead.set(frame.seq, frame);
    if (ahead.size > 10000) {
      console.error(`\n[node] lost a frame: expected #${expected}, got up to #${frame.seq}`);
      exitCode = 2;
      break;
    }
    continue;
  }
  let done = false;
  for (let current = frame; current; current = ahead.get(expected)) {
    ahead.delete(expected);
    expected += 1;
    if (current.kind === "chunk") process.stdout.write(current.text ?? "");
    if (current.kind === "final") {
      const u = current.usage;
      process.stdout.write("\n");
      console.error(`[node] ${current.finish_reason}: ${u.prompt_tokens} prompt + ${u.completion_tokens} completion tokens`);
      done = true;
      break;
    }
  }
  if (done) break;
}
frames.unsubscribe();
alive.unsubscribe();
await nc.close();
process.exit(exitCode);

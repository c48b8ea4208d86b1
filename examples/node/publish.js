// Publishes to delay-bridge with amqplib, then watches what arrives.
//
// Usage: node publish.js [AMQP_URL [INGRESS [CANCEL_EXCHANGE [TARGET]]]]
// The defaults fit config/delay-bridge.toml: amqp://guest:guest@127.0.0.1:5672/%2f,
// delayed, delay-bridge.cancel (<prefix>.cancel), amq.direct.
//
// Four messages, nothing but AMQP: one with x-delay, one with x-deliver-at, one recurring
// (every 2 s, 3 times) and one scheduled, then cancelled by publishing a tombstone. Exits 0
// when each arrived on time (not early, at most 1 s late) and the cancelled one never did.
'use strict';
const amqp = require('amqplib');

const [
  url = 'amqp://guest:guest@127.0.0.1:5672/%2f',
  ingress = 'delayed',
  cancelExchange = 'delay-bridge.cancel',
  target = 'amq.direct',
] = process.argv.slice(2);
const TOLERANCE_MS = 1000;
const clock = (ms) => new Date(ms).toISOString().slice(11, 23);
// amqplib sends a JS number as the smallest integer type that holds it; epoch ms
// should always travel as a signed 64-bit integer ('l'), so say so.
const int64 = (value) => ({ '!': 'long', value });

async function main() {
  const run = `node-${Date.now()}`; // this run's routing key, and the start of its ids
  const connection = await amqp.connect(url);
  const channel = await connection.createConfirmChannel();

  // A queue of our own on the target exchange: due messages are delivered there with the
  // routing key they were published with.
  const { queue } = await channel.assertQueue('', { exclusive: true });
  await channel.bindQueue(queue, target, run);

  const labels = {}; // message_id -> what it is
  const dueAt = {}; // message_id -> when it is due, epoch ms
  const publish = async (messageId, label, headers, due) => {
    channel.publish(ingress, run, Buffer.from(label), { messageId, persistent: true, headers });
    await channel.waitForConfirms();
    labels[messageId] = label;
    dueAt[messageId] = due;
    console.log(`published  ${label.padEnd(20)} ${messageId}`);
  };

  const start = Date.now();
  // 1. A delay in milliseconds, counted from when the bridge reads the message.
  await publish(`${run}-delay`, 'x-delay 3000 ms', { 'x-delay': 3000 }, start + 3000);
  // 2. An absolute time in epoch milliseconds (an RFC 3339 string works too).
  const at = Date.now() + 4000;
  await publish(`${run}-at`, 'x-deliver-at +4 s', { 'x-deliver-at': int64(at) }, at);
  // 3. A recurring schedule: every 2 s, 3 occurrences; it needs a message_id. Each
  //    occurrence arrives with x-occurrence (1, 2, 3) and x-occurrence-due (epoch ms).
  await publish(`${run}-every`, 'every 2 s', { 'x-repeat-every': '2s', 'x-repeat-count': 3 });
  // 4. A message due in 5 s, cancelled at once. x-published-at (epoch ms) says when the
  //    copy entered, so the cancel covers it even before a bridge has read it.
  const cancelled = `${run}-cancelled`;
  const published = Date.now();
  const headers = { 'x-delay': 5000, 'x-published-at': int64(published) };
  await publish(cancelled, 'x-delay 5000 ms', headers, published + 5000);

  // The cancel: a tombstone published to the fanout exchange <prefix>.cancel, with an
  // empty body and message_id = the id to cancel. It drops every copy of the id that
  // entered at or before delay-bridge-cancelled-at; delay-bridge-due-at (optional) lets
  // bridges forget it after that time. Both are epoch ms, 64-bit.
  channel.publish(cancelExchange, '', Buffer.alloc(0), {
    messageId: cancelled,
    persistent: true,
    headers: {
      'delay-bridge-kind': 'cancel',
      'delay-bridge-cancelled-at': int64(Date.now()),
      'delay-bridge-due-at': int64(published + 5000),
    },
  });
  await channel.waitForConfirms();
  console.log(`cancelled  ${'x-delay 5000 ms'.padEnd(20)} ${cancelled} (tombstone confirmed)`);

  // Watch the queue until everything is due, and a little longer.
  console.log('arrivals:');
  console.log(`  ${'message'.padEnd(20)} ${'due'.padEnd(12)}  ${'arrived'.padEnd(12)}  late`);
  const seen = new Set();
  const failures = [];
  await channel.consume(
    queue,
    (message) => {
      const arrived = Date.now();
      const { messageId, headers = {} } = message.properties;
      let label = labels[messageId];
      let due = dueAt[messageId];
      if (headers['x-occurrence'] !== undefined) {
        label = `${label} #${headers['x-occurrence']}`;
        due = headers['x-occurrence-due'];
      }
      const late = arrived - due;
      const shown = `${late >= 0 ? '+' : ''}${late} ms`;
      console.log(`  ${label.padEnd(20)} ${clock(due)}  ${clock(arrived)}  ${shown}`);
      seen.add(label);
      if (messageId === cancelled) failures.push('the cancelled message arrived');
      else if (late < 0 || late > TOLERANCE_MS) failures.push(`${label} arrived ${shown} from its due time`);
    },
    { noAck: true },
  );
  const deadline = start + 6000 + TOLERANCE_MS + 500;
  await new Promise((resolve) => setTimeout(resolve, deadline - Date.now()));
  await connection.close();

  const wanted = ['x-delay 3000 ms', 'x-deliver-at +4 s', 'every 2 s #1', 'every 2 s #2',
    'every 2 s #3'];
  for (const label of wanted) if (!seen.has(label)) failures.push(`${label} never arrived`);
  if (failures.length > 0) {
    console.log(`FAILED: ${failures.join('; ')}`);
    process.exit(1);
  }
  console.log(`ok: ${wanted.length} arrived on time, the cancelled one never`);
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});

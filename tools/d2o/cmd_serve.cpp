// d2o serve: the OpenAI-compatible HTTP server (src/serve/). This file reads the options, loads
// the model, starts the service and the listener, and turns SIGTERM / SIGINT into a drain:
// requests in flight finish, new ones get 503, then the process exits.
#include <malloc.h>
#include <pthread.h>
#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "commands.h"
#include "common.h"
#include "runtime/kv_pool.h"
#include "serve/conn_limits.h"
#include "serve/http_server.h"
#include "serve/service.h"

namespace d2o::cli {

namespace {

struct ServeOptions {
  ModelOptions model;
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string kv_mem = "1G";
  int parallel = 16;
  int queue = 64;
  int chunk = 256;
  int n_predict = 512;
  std::string api_key;
  std::string api_key_file;
  std::string admin_key_name;
  std::string max_body = "4M";
  double drain_s = 30;
  double request_timeout_s = 30;
  int max_conn = 0;  // 0: sized from the open-file limit
  int max_conn_per_addr = 64;
  double rate_per_addr = 100;
  double rate_burst = 200;
  std::string session_dir;
  std::string session_dir_max = "0";
  std::string session_save = "turn";
  std::string compress = "when-needed";
};

// --max-conn, or its default, within what the open-file limit (raised to its hard limit first)
// allows.
std::string format_rate(double r) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", r);
  return b;
}

size_t connection_bound(int asked) {
  const size_t files = serve::raise_open_file_limit();
  const size_t fits = serve::default_max_conn(files);
  if (asked <= 0) return fits;
  if (files > 0 && static_cast<size_t>(asked) > fits) {
    std::fprintf(stderr,
                 "d2o serve: --max-conn %d is more than the open-file limit (%zu) allows; %zu "
                 "instead\n",
                 asked, files, fits);
    return fits;
  }
  return static_cast<size_t>(asked);
}

int run_serve(ServeOptions& o) {
  // SIGTERM / SIGINT go to one thread that drains the server; they are blocked in every other
  // thread (all started below, so they inherit the mask). SIGPIPE from a vanished client is
  // ignored.
  std::signal(SIGPIPE, SIG_IGN);
  // Cache buffers go back to the system when a sequence or session ends (glibc would otherwise
  // raise its mmap threshold and keep freed caches on the heap): RSS follows the load.
  mallopt(M_MMAP_THRESHOLD, 64 * 1024);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  auto cap = parse_byte_size(o.kv_mem);
  if (!cap.ok()) return fail(cap.status().with_context("--kv-mem"));
  auto max_body = parse_byte_size(o.max_body);
  if (!max_body.ok()) return fail(max_body.status().with_context("--max-body"));
  // The keys, read once (rotating them means a restart), before the model loads.
  std::vector<serve::ApiKey> keys;
  if (!o.api_key_file.empty()) {
    auto k = serve::read_api_key_file(o.api_key_file);
    if (!k.ok()) return fail(k.status().with_context("--api-key-file"));
    keys = std::move(k).value();
    std::error_code ec;
    const auto mode = std::filesystem::status(o.api_key_file, ec).permissions();
    using std::filesystem::perms;
    if (!ec && (mode & (perms::group_read | perms::others_read)) != perms::none) {
      std::fprintf(stderr,
                   "d2o serve: warning: %s can be read by other users than its owner (chmod 600 "
                   "it)\n",
                   o.api_key_file.c_str());
    }
  } else if (!o.api_key.empty()) {
    keys.push_back({serve::kDefaultKeyName, o.api_key});
  }
  if (!o.admin_key_name.empty()) {
    if (keys.empty()) {
      return fail(invalid_argument("--admin-key-name needs keys (--api-key-file or --api-key)"));
    }
    if (std::none_of(keys.begin(), keys.end(),
                     [&](const serve::ApiKey& k) { return k.name == o.admin_key_name; })) {
      return fail(
          invalid_argument("--admin-key-name " + o.admin_key_name + ": no key of that name" +
                           (o.api_key_file.empty() ? std::string(" (--api-key is 'default')")
                                                   : " in " + o.api_key_file)));
    }
  }
  // The engine's micro-batch must hold a whole step (every decode row and one prompt chunk).
  o.model.n_ubatch = std::max(o.model.n_ubatch, o.parallel + o.chunk);
  auto loaded = load_all(o.model);
  if (!loaded.ok()) return fail(loaded.status());
  Loaded& l = *loaded;

  serve::ServiceParams sp;
  sp.scheduler.kv_mem_bytes = *cap;
  sp.scheduler.max_running = o.parallel;
  sp.scheduler.prefill_chunk = o.chunk;
  sp.scheduler.kv_type = l.kv_type;
  sp.scheduler.max_positions = l.n_ctx;
  sp.scheduler.eog_tokens = l.tokenizer->eog_tokens();
  sp.max_queue = static_cast<size_t>(o.queue);
  sp.default_kv = l.policy->spec();
  sp.compress =
      o.compress == "always" ? serve::CompressWhen::kAlways : serve::CompressWhen::kWhenNeeded;
  // Sessions' shrunk caches and the requests' small buffers live below the mmap threshold, in
  // malloc's arenas: when they are freed (a session dropped to make room, a request done) glibc
  // keeps the pages, and after a load RSS stayed about 70 MiB above where it started with no
  // KV held at all (tests/e2e/serve_load_test.py). Once nothing runs or waits, they go back.
  sp.on_drained = [] { malloc_trim(0); };
  for (const serve::ApiKey& k : keys) sp.key_names.push_back(k.name);
  if (!o.session_dir.empty()) {
    auto id = serve::model_identity(l.model->path());
    if (!id.ok()) return fail(id.status().with_context("--session-dir"));
    sp.session_dir = o.session_dir;
    if (o.session_dir_max != "0") {  // 0: no bound
      auto dir_max = parse_byte_size(o.session_dir_max);
      if (!dir_max.ok()) return fail(dir_max.status().with_context("--session-dir-max"));
      sp.session_dir_max = *dir_max;
    }
    sp.model_identity = *id;
    sp.save_every_turn = o.session_save == "turn";
  }
  auto service = serve::Service::create(*l.engine, *l.tokenizer, sp);
  if (!service.ok()) return fail(service.status());

  serve::HttpOptions ho;
  ho.host = o.host;
  ho.port = o.port;
  ho.api_keys = keys;
  ho.admin_key_name = o.admin_key_name;
  ho.max_body = *max_body;
  ho.request_timeout_s = o.request_timeout_s;
  ho.max_conn = connection_bound(o.max_conn);
  ho.max_conn_per_addr = static_cast<size_t>(o.max_conn_per_addr);
  ho.rate_per_addr = o.rate_per_addr;
  ho.rate_burst = o.rate_burst;
  // What hundreds of connections held (their buffers, the handler threads' arenas) goes back
  // once they have closed, as the requests' memory does when the service drains.
  ho.on_quiet = [] { malloc_trim(0); };
  // Every running or queued request holds a handler thread while it waits; a few more answer
  // the quick endpoints (and the 503s) meanwhile.
  ho.http_threads = o.parallel + o.queue + 8;
  ho.model_name =
      std::filesystem::path(o.model.model.empty() ? default_model_path() : o.model.model)
          .stem()
          .string();
  ho.default_max_tokens = o.n_predict;
  ho.n_ctx = l.n_ctx;
  ho.default_kv = l.policy->spec();
  const ChatTemplate* tmpl = l.chat_template ? &*l.chat_template : nullptr;
  serve::HttpServer http(**service, *l.tokenizer, tmpl, ho);

  if (Status s = http.bind(); !s.ok()) return fail(s);
  std::atomic<bool> ended{false};
  std::thread signals([&] {
    int sig = 0;
    sigwait(&set, &sig);
    if (ended) return;  // woken below: the listener ended by itself
    std::fprintf(stderr, "d2o serve: %s, finishing requests in flight\n",
                 sig == SIGTERM ? "SIGTERM" : "SIGINT");
    http.stop(o.drain_s);
  });
  std::fprintf(stderr,
               "d2o serve: %s on http://%s:%d (kv %s, kv-mem %s, parallel %d, context %d)\n",
               ho.model_name.c_str(), o.host.c_str(), http.port(), l.policy->spec().c_str(),
               format_bytes(static_cast<double>(*cap)).c_str(), o.parallel, l.n_ctx);
  std::fprintf(
      stderr,
      "d2o serve: connections: at most %zu open, %s per client address; requests: %s "
      "per client address\n",
      ho.max_conn, ho.max_conn_per_addr ? std::to_string(ho.max_conn_per_addr).c_str() : "no bound",
      ho.rate_per_addr > 0
          ? (format_rate(ho.rate_per_addr) + "/s, bursts of " + format_rate(ho.rate_burst)).c_str()
          : "no bound");
  if (keys.size() > 1) {
    std::fprintf(stderr, "d2o serve: %zu API keys; /metrics: %s\n", keys.size(),
                 o.admin_key_name.empty()
                     ? "closed to every key (no --admin-key-name)"
                     : ("the admin key '" + o.admin_key_name + "' only").c_str());
  }
  std::fflush(stderr);
  http.run();
  ended = true;
  pthread_kill(signals.native_handle(), SIGTERM);  // wakes it if the listener ended first
  signals.join();
  service->reset();
  std::fprintf(stderr, "d2o serve: stopped\n");
  return 0;
}

}  // namespace

Action add_serve_command(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* sub = app.add_subcommand("serve",
                                     "OpenAI-compatible HTTP server with kept, "
                                     "compressed conversations");
  add_model_options(sub, o->model, /*with_kv=*/true);
  sub->add_option("--host", o->host, "Address to listen on (default 127.0.0.1)");
  sub->add_option("--port", o->port, "Port (0: any free port, printed at start)")
      ->check(CLI::Range(0, 65535));
  sub->add_option("--kv-mem", o->kv_mem,
                  "KV memory cap shared by running requests and kept sessions (e.g. 512M, 1G)");
  sub->add_option("--parallel", o->parallel, "Sequences decoded together at most")
      ->check(CLI::Range(1, 256));
  sub->add_option("--queue", o->queue, "Requests that may wait for admission before 503")
      ->check(CLI::Range(1, 4096));
  sub->add_option("--chunk", o->chunk, "Prompt tokens per prefill pass")
      ->check(CLI::Range(1, 8192));
  sub->add_option("-n,--n-predict", o->n_predict,
                  "max_tokens of requests that give none (bounded by the context)")
      ->check(CLI::Range(1, 1 << 24));
  CLI::Option* key = sub->add_option("--api-key", o->api_key,
                                     "Require 'Authorization: Bearer KEY' (one key, named "
                                     "'default')");
  sub->add_option("--api-key-file", o->api_key_file,
                  "API keys, one 'name:key' per line: each name has its own sessions and "
                  "/metrics counters (read at start; a change needs a restart)")
      ->excludes(key);
  sub->add_option("--admin-key-name", o->admin_key_name,
                  "With several keys, the name of the one that may read /metrics");
  sub->add_option("--max-body", o->max_body, "Largest request body (e.g. 4M); larger gets 413");
  sub->add_option("--request-timeout", o->request_timeout_s,
                  "Seconds a request's header and body together may take to arrive (408 after)")
      ->check(CLI::Range(0.1, 3600.0));
  sub->add_option("--max-conn", o->max_conn,
                  "Open connections at most (default: the open-file limit less 128, at most "
                  "16384); at the bound idle kept-alive connections are closed first, then new "
                  "ones get 503")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--max-conn-per-addr", o->max_conn_per_addr,
                  "Open connections from one client address (default 64; 0: no bound); more "
                  "get 503")
      ->check(CLI::Range(0, 1 << 20));
  sub->add_option("--rate-per-addr", o->rate_per_addr,
                  "Requests a second from one client address (default 100; 0: no bound; behind a "
                  "proxy every client has its address); more get 429 with Retry-After")
      ->check(CLI::Range(0.0, 1e6));
  sub->add_option("--rate-burst", o->rate_burst,
                  "Requests one client address may send at once before --rate-per-addr applies "
                  "(default 200)")
      ->check(CLI::Range(1.0, 1e6));
  sub->add_option("--drain", o->drain_s, "Seconds requests in flight may take after SIGTERM")
      ->check(CLI::Range(0.0, 3600.0));
  sub->add_option("--compress", o->compress,
                  "When KV caches are compressed: 'when-needed' (default: caches stay full while "
                  "--kv-mem allows; idle sessions are compressed step by step, least recently "
                  "used first, down to their policy's budget when room is needed, and only then "
                  "written out or dropped) or 'always' (every sequence to its policy's budget "
                  "from its first pass)")
      ->check(CLI::IsMember({"when-needed", "always"}));
  CLI::Option* dir =
      sub->add_option("--session-dir", o->session_dir,
                      "Write kept sessions to this directory and read them back (also after a "
                      "restart)");
  sub->add_option("--session-dir-max", o->session_dir_max,
                  "The most the session files may hold together, e.g. 2G (powers of 1024; 0: no "
                  "bound): past it, the least recently used files are removed")
      ->needs(dir);
  sub->add_option("--session-save", o->session_save,
                  "When sessions are written: 'turn' (when each request ends; default) or "
                  "'evict' (only when they leave memory and at shutdown)")
      ->check(CLI::IsMember({"turn", "evict"}))
      ->needs(dir);
  return [o] { return run_serve(*o); };
}

}  // namespace d2o::cli

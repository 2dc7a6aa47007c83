// The parts of a llama.cpp verify step over n tokens, timed in-process with llama.cpp's own library (libllama and
// libcommon of the build scripts/setup_llamacpp.sh made), for benchmarks/verify_split.py:
//   last_ms  the target's pass over n tokens after `depth` cached ones, logits of the last position only (what
//            llama-bench's prompt pass and a plain decode step compute);
//   all_ms   the same pass with logits at every position (what a verify step computes): all_ms - last_ms is the
//            output matrix over the n - 1 extra rows (and their copy out);
//   sample_ms  common_sampler_sample at one position with the sampling llama-server runs for a greedy request
//            (temperature 0, top-k 1; the sampler chain llama-server builds from them), the median per position.
// After each pass the n tokens leave the KV cache again (llama_memory_seq_rm), as a rejected draft's do.
// Usage: verify_split MODEL THREADS DEPTH SIZES(comma list) REPEATS REPACK(0|1)   -> one JSON object on stdout.
#include "llama.h"
#include "sampling.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    size_t m = v.size() / 2;
    return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

// one decode of `tokens` at positions pos.., logits at every position or the last only; ms of the pass
static double timed_pass(llama_context * ctx, const std::vector<llama_token> & tokens, int pos, bool all_logits) {
    llama_batch batch = llama_batch_init((int) tokens.size(), 0, 1);
    for (size_t i = 0; i < tokens.size(); i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = pos + (int) i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = all_logits || i + 1 == tokens.size();
    }
    batch.n_tokens = (int) tokens.size();
    auto start = std::chrono::steady_clock::now();
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "verify_split: llama_decode failed\n");
        exit(1);
    }
    llama_synchronize(ctx);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    llama_batch_free(batch);
    return ms;
}

int main(int argc, char ** argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: verify_split MODEL THREADS DEPTH SIZES REPEATS REPACK\n");
        return 2;
    }
    const int threads = atoi(argv[2]), depth = atoi(argv[3]), repeats = atoi(argv[5]);
    std::vector<int> sizes;
    std::stringstream list(argv[4]);
    for (std::string item; std::getline(list, item, ',');) sizes.push_back(atoi(item.c_str()));
    const int largest = *std::max_element(sizes.begin(), sizes.end());

    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.use_extra_bufts = atoi(argv[6]) != 0;
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (!model) {
        fprintf(stderr, "verify_split: cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = depth + largest + 16;
    cparams.n_batch = cparams.n_ubatch = std::max(depth, largest);
    cparams.n_threads = cparams.n_threads_batch = threads;
    llama_context * ctx = llama_init_from_model(model, cparams);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    // a fixed pseudo-random context and continuation (ids from the middle of the vocabulary: ordinary tokens)
    std::vector<llama_token> ids(depth + largest);
    unsigned state = 12345;
    for (auto & id : ids) {
        state = state * 1103515245u + 12345u;
        id = (llama_token) (1000 + (state >> 8) % (unsigned) (n_vocab / 2));
    }
    timed_pass(ctx, std::vector<llama_token>(ids.begin(), ids.begin() + depth), 0, false);

    common_params_sampling sparams;
    sparams.temp = 0.0f;
    sparams.top_k = 1;
    common_sampler * smpl = common_sampler_init(model, sparams);

    printf("{\"n_vocab\": %d, \"sizes\": {", n_vocab);
    for (size_t s = 0; s < sizes.size(); s++) {
        const int n = sizes[s];
        std::vector<llama_token> step(ids.begin() + depth, ids.begin() + depth + n);
        std::vector<double> last, all, sample;
        for (int r = 0; r <= repeats; r++) {  // round 0 warms up and is dropped
            double t_last = timed_pass(ctx, step, depth, false);
            llama_memory_seq_rm(llama_get_memory(ctx), 0, depth, -1);
            double t_all = timed_pass(ctx, step, depth, true);
            for (int i = 0; i < n; i++) {
                auto start = std::chrono::steady_clock::now();
                common_sampler_sample(smpl, ctx, i);
                double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
                if (r > 0) sample.push_back(ms);
            }
            llama_memory_seq_rm(llama_get_memory(ctx), 0, depth, -1);
            if (r > 0) {
                last.push_back(t_last);
                all.push_back(t_all);
            }
        }
        printf("%s\"%d\": {\"last_ms\": %.4f, \"all_ms\": %.4f, \"sample_ms\": %.4f}", s ? ", " : "", n,
               median(last), median(all), median(sample));
    }
    printf("}}\n");
    common_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}

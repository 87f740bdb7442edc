// parallel.tsp_tables: how TSP's vocabulary tables (the embedding and the untied LM head, their
// rows split by vocabulary over the tsp group) meet each rank's tokens. No MPI or CUDA here
// (keel size and the config reader use it on any machine).
//   sweep   each rank's rows visit every rank of the group in pieces, as the layers' weight
//           shards do (tsp.h): per step each table's rows travel in forward and again in
//           backward, and their gradients back (about V x D values per table, whatever the
//           tokens).
//   gather  the rows stay; the tokens travel, as under tensor + sequence parallelism: the
//           embedding looks up every token of the micro-batch in this rank's rows (ids
//           all-gathered) and the partial rows are reduce-scattered back to the tokens' ranks;
//           the head all-gathers the final hidden states, scores every token against this
//           rank's rows, and the per-token statistics go to the tokens' ranks (all-to-all);
//           backward all-gathers the embedding's output gradient and reduce-scatters the head's
//           input gradient (about micro-batch tokens x D values per table).
//   auto    gather when the micro-batch has at most as many tokens as the vocabulary has rows
//           (the traffic above is then no larger), sweep otherwise.
#pragma once

#include <cstdint>
#include <string>

namespace keel::parallel {

enum class TspTables { kAuto, kSweep, kGather };

// "auto", "sweep", "gather"; keel::UsageError naming the word otherwise.
TspTables parse_tsp_tables(const std::string& word);
// Whether a run gathers (kAuto resolved): tokens is the micro-batch's (micro_batch x seq_length,
// every rank's together), vocab the vocabulary's rows.
bool tsp_gathers_tables(TspTables t, std::int64_t tokens, std::int64_t vocab);

}  // namespace keel::parallel

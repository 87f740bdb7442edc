// common/udp.h: HOST:PORT parsing, and a datagram from a UdpSender arriving whole at a
// UdpReceiver on this host (keel run's heartbeats across nodes).
#include "common/udp.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "common/error.h"

namespace keel {
namespace {

TEST(Udp, ParsesHostPort) {
  std::string host, why;
  int port = 0;
  EXPECT_TRUE(parse_host_port("node7:4242", &host, &port, &why));
  EXPECT_EQ(host, "node7");
  EXPECT_EQ(port, 4242);
  EXPECT_TRUE(parse_host_port("[::1]:9", &host, &port, &why));
  EXPECT_EQ(host, "::1");
  EXPECT_EQ(port, 9);
  for (const char* bad : {"", "node7", ":80", "node7:", "node7:0", "node7:65536", "node7:8x", "[::1]9", "node7:123456"}) {
    EXPECT_FALSE(parse_host_port(bad, &host, &port, &why)) << bad;
    EXPECT_FALSE(why.empty()) << bad;
  }
}

TEST(Udp, ADatagramArrivesWholeAndInOrder) {
  UdpReceiver rx(0);
  ASSERT_GT(rx.port(), 0);
  EXPECT_TRUE(rx.drain().empty());
  UdpSender tx("127.0.0.1", rx.port());
  const std::string big(8000, 'x');  // a heartbeat is ~300 bytes; 8 KB still one datagram
  ASSERT_TRUE(tx.send("{\"rank\":0}"));
  ASSERT_TRUE(tx.send(big));
  std::vector<std::string> got;
  for (int i = 0; i < 100 && got.size() < 2; ++i) {
    for (auto& d : rx.drain()) got.push_back(d);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], "{\"rank\":0}");
  EXPECT_EQ(got[1], big);
  EXPECT_TRUE(rx.drain().empty());
}

TEST(Udp, AnUnknownHostIsAnError) {
  EXPECT_THROW(UdpSender("no-such-host.invalid", 9), Error);
}

}  // namespace
}  // namespace keel

// Datagrams for keel run's heartbeats across nodes (train/heartbeat.h, run/supervisor.h): a
// rank's heartbeat file on a shared file system can sit behind a checkpoint's writes of the same
// file system for seconds, a datagram does not. One small JSON text per datagram, best effort:
// the sender never blocks (a full socket buffer drops the beat; the next one replaces it).
#pragma once

#include <sys/socket.h>

#include <string>
#include <vector>

namespace keel {

// "HOST:PORT" (PORT 1-65535; HOST a name or an IPv4 / IPv6 address, [v6] bracketed). Returns
// false and the reason when malformed.
bool parse_host_port(const std::string& text, std::string* host, int* port, std::string* why);

class UdpSender {
 public:
  // Resolves host:port (keel::Error naming it when it cannot). The socket is non-blocking.
  UdpSender(const std::string& host, int port);
  ~UdpSender();
  UdpSender(const UdpSender&) = delete;
  UdpSender& operator=(const UdpSender&) = delete;
  // Sends one datagram; false (errno kept) when the kernel refused it.
  bool send(const std::string& text);

 private:
  int fd_ = -1;
  sockaddr_storage addr_{};
  socklen_t len_ = 0;
};

class UdpReceiver {
 public:
  // Binds a non-blocking socket to every interface (IPv4), on `port` (0: any free one).
  explicit UdpReceiver(int port = 0);
  ~UdpReceiver();
  UdpReceiver(const UdpReceiver&) = delete;
  UdpReceiver& operator=(const UdpReceiver&) = delete;
  int port() const { return port_; }
  // Every datagram that arrived since the last call, oldest first.
  std::vector<std::string> drain();

 private:
  int fd_ = -1, port_ = 0;
};

}  // namespace keel

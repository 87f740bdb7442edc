#include "common/udp.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/error.h"

namespace keel {

bool parse_host_port(const std::string& text, std::string* host, int* port, std::string* why) {
  std::string h, p;
  if (!text.empty() && text[0] == '[') {  // [v6]:port
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      *why = "expected [ADDRESS]:PORT";
      return false;
    }
    h = text.substr(1, close - 1), p = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      *why = "expected HOST:PORT";
      return false;
    }
    h = text.substr(0, colon), p = text.substr(colon + 1);
  }
  if (h.empty() || p.empty() || p.size() > 5 || p.find_first_not_of("0123456789") != std::string::npos) {
    *why = "expected HOST:PORT with a port of 1-65535";
    return false;
  }
  const int v = std::stoi(p);
  if (v < 1 || v > 65535) {
    *why = "the port must be 1-65535";
    return false;
  }
  *host = h, *port = v;
  return true;
}

UdpSender::UdpSender(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); rc != 0 || !res)
    fail("cannot resolve {}:{}: {}", host, port, gai_strerror(rc));
  std::memcpy(&addr_, res->ai_addr, res->ai_addrlen);
  len_ = static_cast<socklen_t>(res->ai_addrlen);
  fd_ = ::socket(res->ai_family, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  freeaddrinfo(res);
  if (fd_ < 0) fail("cannot open a UDP socket for {}:{}: {}", host, port, std::strerror(errno));
}

UdpSender::~UdpSender() {
  if (fd_ >= 0) ::close(fd_);
}

bool UdpSender::send(const std::string& text) {
  return ::sendto(fd_, text.data(), text.size(), 0, reinterpret_cast<const sockaddr*>(&addr_), len_) ==
         static_cast<ssize_t>(text.size());
}

UdpReceiver::UdpReceiver(int port) {
  fd_ = ::socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd_ < 0) fail("cannot open a UDP socket: {}", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    const int e = errno;
    ::close(fd_);
    fail("cannot bind a UDP socket to port {}: {}", port, std::strerror(e));
  }
  socklen_t len = sizeof a;
  ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
  port_ = ntohs(a.sin_port);
  int size = 4 << 20;  // room for many ranks' beats between two polls
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
}

UdpReceiver::~UdpReceiver() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<std::string> UdpReceiver::drain() {
  std::vector<std::string> out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n < 0) break;  // EAGAIN: nothing more (or an error: next poll)
    out.emplace_back(buf, static_cast<std::size_t>(n));
  }
  return out;
}

}  // namespace keel

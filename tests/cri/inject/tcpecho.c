/*
 * The workload of the inject_images suite, built for each kind of image (glibc
 * 2.17 symbol versions, musl dynamic, static): plain blocking sockets.
 *
 *   tcpecho serve PORT          accepts connections one after another and echoes
 *                               each until EOF
 *   tcpecho client IP PORT N    sends N bytes in 64 KiB chunks, reads each back,
 *                               checks it, prints "ok N"; exit 1 on any error
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static char buf[65536], back[65536];

static int full(int fd, char *p, size_t n, int writing) {
    while (n > 0) {
        ssize_t r = writing ? write(fd, p, n) : read(fd, p, n);
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "serve") == 0) {
        int s = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)atoi(argv[2]))};
        setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) != 0 || listen(s, 16) != 0) {
            perror("serve");
            return 1;
        }
        printf("listening\n");
        fflush(stdout);
        for (;;) {
            int c = accept(s, NULL, NULL);
            if (c < 0)
                continue;
            ssize_t n;
            while ((n = read(c, buf, sizeof buf)) > 0)
                if (full(c, buf, (size_t)n, 1) != 0)
                    break;
            close(c);
        }
    }
    if (argc == 5 && strcmp(argv[1], "client") == 0) {
        long total = atol(argv[4]), done = 0;
        int s = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)atoi(argv[3]))};
        if (s < 0 || inet_pton(AF_INET, argv[2], &a.sin_addr) != 1 ||
            connect(s, (struct sockaddr *)&a, sizeof a) != 0) {
            perror("connect");
            return 1;
        }
        while (done < total) {
            size_t n = (size_t)(total - done < (long)sizeof buf ? total - done : (long)sizeof buf);
            for (size_t i = 0; i < n; i++)
                buf[i] = (char)((done + (long)i) * 31);
            if (full(s, buf, n, 1) != 0 || full(s, back, n, 0) != 0 || memcmp(buf, back, n) != 0) {
                fprintf(stderr, "echo failed after %ld bytes\n", done);
                return 1;
            }
            done += (long)n;
        }
        close(s);
        printf("ok %ld\n", done);
        return 0;
    }
    fprintf(stderr, "usage: tcpecho serve PORT | tcpecho client IP PORT BYTES\n");
    return 2;
}
